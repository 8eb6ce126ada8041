"""Moved to lwm.inference.dictionary; this old path stays until the scripts outside the package import the new one."""

from lwm.inference.dictionary import CodeDictionary, load_dictionaries  # noqa: F401
