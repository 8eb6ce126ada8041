"""Moved to lwm.training.module; this old path stays until the scripts outside the package import the new one."""

from lwm.training.module import WorldModelModule  # noqa: F401
from lwm.training.optim import OptimConfig  # noqa: F401
