"""Callbacks: one concern each."""

from lwm.callbacks.progress import StepProgressBar

__all__ = ["StepProgressBar"]
