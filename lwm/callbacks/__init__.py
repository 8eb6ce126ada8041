"""Callbacks: one concern each."""

from lwm.callbacks.progress import StepProgressBar
from lwm.callbacks.revival import DeadCodeRevival
from lwm.callbacks.slurm import SlurmRequeue

__all__ = ["DeadCodeRevival", "SlurmRequeue", "StepProgressBar"]
