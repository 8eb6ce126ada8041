"""Code dictionaries at the end of fit: the action and world code tuples the trained encoders use on the
training data, with counts, saved as ``codes.pt`` beside the checkpoints (see :mod:`lwm.codes`)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
from typing_extensions import override

from lwm.callbacks.ranks import every_rank
from lwm.codes import collect, save_dictionaries
from lwm.errors import ConfigError, DataError


class CodeDictionaries(L.Callback):
    """After training, encodes up to ``max_windows`` fixed training windows (None: all; each rank its share)
    and writes ``RUN_DIR/checkpoints/codes.pt``: the code tuples of both quantizers with their counts."""

    def __init__(self, max_windows: int | None = 4096) -> None:
        if max_windows is not None and max_windows < 1:
            raise ConfigError(f"code_dictionaries.max_windows must be >= 1 (or null: all), got {max_windows}")
        self.max_windows = max_windows
        self.path: Path | None = None

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        dm = trainer.datamodule
        if dm is None or not hasattr(dm, "code_loader"):
            return
        if any(getattr(c, "preempted", False) for c in trainer.callbacks):  # stopped by a signal (SlurmRequeue)
            return
        was_training = pl_module.training
        pl_module.eval()
        error = None
        try:
            with trainer.precision_plugin.forward_context():  # the encoders as training ran them (bf16 autocast)
                dictionaries, windows = collect(pl_module.model, dm.code_loader(self.max_windows), pl_module.device)
        except DataError as e:  # bad windows on this rank: every rank raises it, after the gather (no rank hangs)
            dictionaries, windows, error = {}, 0, str(e)
        finally:
            pl_module.train(was_training)
        if trainer.world_size > 1:
            gathered = every_rank(trainer, ({k: d.to_state() for k, d in dictionaries.items()}, windows, error))
            error = next((e for _, _, e in gathered if e), None)
            if trainer.is_global_zero and error is None:
                for states, n, _ in gathered[1:]:
                    for name, state in states.items():
                        dictionaries[name].merge(type(dictionaries[name]).from_state(state))
                    windows += n
        if error is not None:
            raise DataError(error)
        if trainer.is_global_zero:
            directory = Path(trainer.checkpoint_callback.dirpath) if trainer.checkpoint_callback else Path(trainer.default_root_dir)
            self.path = save_dictionaries(directory / "codes.pt", dictionaries, windows, trainer.global_step)
