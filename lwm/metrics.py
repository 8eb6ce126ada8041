"""Moved to lwm.utils.metrics; this old path stays until the scripts outside the package import the new one."""

from lwm.utils.metrics import code_ids, linear_probe_accuracy, nmi  # noqa: F401
