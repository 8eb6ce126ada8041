"""Callbacks: one concern each. :data:`DEFAULTS` is the set every run has, each configured under its key
(``--revival.every_n_steps 10``); more come from a config's ``trainer.callbacks`` list (Lightning's ``class_path``)."""

from lwm.callbacks.attention import AttentionDiagonality
from lwm.callbacks.baseline import CopyLastBaseline
from lwm.callbacks.code_dictionaries import CodeDictionaries
from lwm.callbacks.codebooks import CodebookMonitor
from lwm.callbacks.flop_counter import FlopCounter
from lwm.callbacks.lr import LearningRateMonitor
from lwm.callbacks.predictions import PredictionWriter
from lwm.callbacks.probes import GroundTruthProbes
from lwm.callbacks.progress import StepProgressBar
from lwm.callbacks.revival import DeadCodeRevival
from lwm.callbacks.sensitivity import Sensitivity
from lwm.callbacks.slurm import SlurmRequeue
from lwm.callbacks.summary import ModelSummary
from lwm.callbacks.videos import RolloutVideos

# key in the config -> (callback, its --help section title)
DEFAULTS = {
    "revival": (DeadCodeRevival, "dead-code revival of both quantizers"),
    "codebooks": (CodebookMonitor, "codebook usage, diversity and EMA decay in the logs"),
    "diagonality": (AttentionDiagonality, "the action encoder's temporal attention diagonality"),
    "sensitivity": (Sensitivity, "action and world sensitivity (dPSNR) after each validation"),
    "flops": (FlopCounter, "TFLOPs of training and MFU"),
    "code_dictionaries": (CodeDictionaries, "code dictionaries (codes.pt) at the end of fit"),
    "rollout_videos": (RolloutVideos, "rollout videos at validation"),
    "copy_last": (CopyLastBaseline, "the copy-last-frame baseline of validation"),
    "probes": (GroundTruthProbes, "NMI and linear probes of the codes against true labels"),
    "progress_bar": (StepProgressBar, "the progress bar"),
    "model_summary": (ModelSummary, "the model summary at the start"),
    "slurm_requeue": (SlurmRequeue, "preemption and requeue; outside SLURM Ctrl-C and kill save too"),
    "lr_monitor": (LearningRateMonitor, "the learning rate in the logs (Train_Total/lr/pg1, /pg2)"),
    "prediction_writer": (PredictionWriter, "lwm predict's codes per window"),
}
