"""Step time with and without the monitoring callbacks, side by side in one process.

    python benchmarks/monitoring.py [--size tiny|base] [--steps 40] [--log-every 10] [--precision 32-true|bf16-mixed]

Trains the same model on the same in-memory batches through Lightning three times, each in a fresh Trainer:
without callbacks, with the training-time monitors (codebook usage/diversity + EMA decay, FLOP counter,
dead-code revival), and again without (to see the noise). Also times one validation pass without and with
the validation monitors (attention diagonality, sensitivities). Prints a markdown table; the ratios are the
result (absolute times only mean something on a quiet machine).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from datetime import date

import lightning as L
import torch

from lwm.callbacks import AttentionDiagonality, CodebookMonitor, DeadCodeRevival, FlopCounter, Sensitivity
from lwm.training.loggers import CSVLogger
from lwm.training.optim import OptimConfig
from lwm.training.module import WorldModelModule
from lwm.modules.world_model import WorldModelConfig

SIZES = {
    "tiny": (WorldModelConfig(in_channels=4, height=16, width=16, d_model=64, n_heads=4, depth_action=2, depth_world=2,
                              depth_dynamics=2, d_code_action=8, d_code_world=8, codebook_sizes_action=(4, 8),
                              codebook_sizes_world=(4, 8)), 4, 8),
    "base": (WorldModelConfig(), 8, 16),
}


class StepTimer(L.Callback):
    def __init__(self, skip: int) -> None:
        self.skip, self.times, self._t = skip, [], 0.0

    def on_train_batch_start(self, trainer, *args) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer, *args) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if trainer.global_step > self.skip:
            self.times.append(time.perf_counter() - self._t)


def batches(size: str, n: int, device: str) -> list[dict[str, torch.Tensor]]:
    net, batch, frames = SIZES[size]
    g = torch.Generator().manual_seed(0)
    return [{"latents": torch.tanh(torch.randn(batch, frames, net.in_channels, net.height, net.width, generator=g))}
            for _ in range(n)]


def fit(size: str, data, callbacks: list, steps: int, log_every: int, precision: str, root: str) -> float:
    torch.manual_seed(0)
    module = WorldModelModule(net=SIZES[size][0], optim=OptimConfig(warmup_steps=0))
    timer = StepTimer(skip=3)
    trainer = L.Trainer(max_steps=steps, accelerator="auto", devices=1, precision=precision, logger=CSVLogger(root),
                        log_every_n_steps=log_every, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[timer, *callbacks], limit_val_batches=0)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    return 1000 * statistics.median(timer.times)


def validate(size: str, data, callbacks: list, precision: str, root: str) -> float:
    torch.manual_seed(0)
    module = WorldModelModule(net=SIZES[size][0])
    trainer = L.Trainer(accelerator="auto", devices=1, precision=precision, logger=CSVLogger(root),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks)
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    trainer.validate(module, loader, verbose=False)  # warm-up
    t = time.perf_counter()
    trainer.validate(module, loader, verbose=False)
    return 1000 * (time.perf_counter() - t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--val-batches", type=int, default=4)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    data = batches(args.size, args.steps, device)
    train_monitors = lambda: [CodebookMonitor(), FlopCounter(), DeadCodeRevival()]  # noqa: E731
    with tempfile.TemporaryDirectory() as root:
        rows = [
            ("train step, no callbacks", fit(args.size, data, [], args.steps, args.log_every, args.precision, root)),
            ("train step, monitors", fit(args.size, data, train_monitors(), args.steps, args.log_every, args.precision, root)),
            ("train step, no callbacks (again)", fit(args.size, data, [], args.steps, args.log_every, args.precision, root)),
        ]
        val = data[: args.val_batches]
        rows += [
            (f"validation ({args.val_batches} batches), no callbacks", validate(args.size, val, [], args.precision, root)),
            (f"validation ({args.val_batches} batches), monitors",
             validate(args.size, val, [CodebookMonitor(), AttentionDiagonality(), Sensitivity()], args.precision, root)),
        ]
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}, {date.today()}, size {args.size}, precision {args.precision}, "
          f"log every {args.log_every} steps, median of {args.steps - 4} steps")
    print("| what | ms |\n|---|---|")
    for label, ms in rows:
        print(f"| {label} | {ms:.1f} |")
    base = (rows[0][1] + rows[2][1]) / 2
    print(f"\ntrain-step ratio, monitors / none: {rows[1][1] / base:.3f}; validation ratio: {rows[4][1] / rows[3][1]:.2f}")


if __name__ == "__main__":
    main()
