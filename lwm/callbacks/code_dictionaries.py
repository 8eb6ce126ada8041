"""Code dictionaries at the end of fit: the action and world code tuples the trained encoders use on the training
data, with counts, saved as ``codes.pt`` beside the checkpoints (see :mod:`lwm.inference.dictionary`)."""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L

from lwm.inference.dictionary import collect, dictionaries_step, save_dictionaries
from lwm.training.trainer_state import every_rank
from lwm.utils.errors import ConfigError, DataError

log = logging.getLogger(__name__)


class CodeDictionaries(L.Callback):
    """After training, encodes up to ``max_windows`` fixed training windows (None: all; each rank its share) and
    writes ``RUN_DIR/checkpoints/codes.pt``."""

    def __init__(self, max_windows: int | None = 4096) -> None:
        if max_windows is not None and max_windows < 1:
            raise ConfigError(f"code_dictionaries.max_windows must be >= 1 (or null: all), got {max_windows}")
        self.max_windows = max_windows
        self.path: Path | None = None
        self._train_ended = False

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._train_ended = False

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._train_ended = True
        self._write(trainer, pl_module)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A fit whose training loop did not run (resumed with training over): the dictionaries, unless there."""
        if self._train_ended or trainer.global_step == 0:
            return
        path, missing = _directory(trainer) / "codes.pt", False
        if trainer.is_global_zero:
            try:
                missing = (dictionaries_step(path) if path.is_file() else None) != trainer.global_step
            except DataError:  # unreadable: written anew
                missing = True
        missing = trainer.strategy.broadcast(missing, src=0)  # every rank encodes its share: all agree
        if missing:
            if trainer.is_global_zero:
                log.warning(f"{path}: missing or not of step {trainer.global_step} (training is over; a preemption "
                            f"at its last step, say): writing it")
            self._write(trainer, pl_module)

    def _write(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        dm = trainer.datamodule
        preempted = any(getattr(c, "preempted", False) for c in trainer.callbacks)  # stopped by a signal: no files,
        if dm is None or not hasattr(dm, "code_loader") or preempted or trainer.fast_dev_run:  # nor in a trial run
            return
        was_training, error = pl_module.training, None
        pl_module.eval()
        try:  # the encoders as training ran them (bf16 autocast)
            dictionaries, windows = collect(pl_module.model, dm.code_loader(self.max_windows), pl_module.device,
                                            forward_context=trainer.precision_plugin.forward_context)
        except DataError as e:  # bad windows on this rank
            dictionaries, windows, error = {}, 0, str(e)
        finally:
            pl_module.train(was_training)
        gathered = every_rank(trainer, ({k: d.to_state() for k, d in dictionaries.items()}, windows, error))
        error = next((e for _, _, e in gathered if e), None)
        if trainer.is_global_zero and error is None:
            for states, n, _ in gathered[1:]:  # the other ranks' counts
                for name, state in states.items():
                    dictionaries[name].merge(type(dictionaries[name]).from_state(state))
                windows += n
        if error is not None:
            raise DataError(error)
        if trainer.is_global_zero:
            self.path = save_dictionaries(_directory(trainer) / "codes.pt", dictionaries, windows, trainer.global_step)


def _directory(trainer: L.Trainer) -> Path:
    return Path(trainer.checkpoint_callback.dirpath) if trainer.checkpoint_callback else Path(trainer.default_root_dir)
