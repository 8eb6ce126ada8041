"""Callbacks: one concern each."""

from lwm.callbacks.attention import AttentionDiagonality
from lwm.callbacks.baseline import CopyLastBaseline
from lwm.callbacks.codebooks import CodebookMonitor
from lwm.callbacks.code_dictionaries import CodeDictionaries
from lwm.callbacks.flop_counter import FlopCounter
from lwm.callbacks.lr import LearningRateMonitor
from lwm.callbacks.predictions import PredictionWriter
from lwm.callbacks.probes import GroundTruthProbes
from lwm.callbacks.progress import StepProgressBar
from lwm.callbacks.revival import DeadCodeRevival
from lwm.callbacks.sensitivity import Sensitivity
from lwm.callbacks.summary import ModelSummary
from lwm.callbacks.slurm import SlurmRequeue
from lwm.callbacks.videos import RolloutVideos

__all__ = [
    "AttentionDiagonality", "CodebookMonitor", "CodeDictionaries", "CopyLastBaseline", "FlopCounter",
    "DeadCodeRevival", "GroundTruthProbes", "LearningRateMonitor", "ModelSummary", "PredictionWriter", "RolloutVideos", "Sensitivity",
    "SlurmRequeue", "StepProgressBar",
]
