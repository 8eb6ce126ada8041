"""Moved to lwm.inference.study; this old path stays until the scripts outside the package import the new one."""

from lwm.inference.study import Clips, evaluate, load_clips, probe_margin  # noqa: F401
