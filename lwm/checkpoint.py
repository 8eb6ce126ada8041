"""Moved to lwm.training.checkpoint; this old path stays until the scripts outside the package import the new one."""

from lwm.training.checkpoint import load_checkpoint, trained_window  # noqa: F401
