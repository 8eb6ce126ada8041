"""DDP through Lightning and the real CLI: 2 gloo processes on the CPU (Lightning's launcher re-runs the command
line for rank 1). The ranks keep identical quantizers while training on different windows, and validation
metrics are exact means over the whole validation set, also when the ranks hold different numbers of windows."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lwm.data.datamodule import LatentDataModule
from lwm.training.module import WorldModelModule
from tests.lightning.helpers import make_dataset, read_metrics, run
from tests.lightning.procs import one_thread, run_lwm

pytestmark = pytest.mark.slow  # end-to-end: `make test-fast` leaves it out


@pytest.fixture(autouse=True)
def _one_thread():  # in-process runs too (a busy 2-core machine; see procs.lwm_env)
    with one_thread():
        yield


# DDPStrategy with the buffer broadcast off (as configs/ddp.yaml): the quantizers must keep the ranks identical on
# their own (all-reduced EMA statistics, codes revived on rank 0 and broadcast), not through DDP re-broadcasting
# rank 0's buffers before every forward.
DDP = ["--trainer.devices=2", "--trainer.strategy=lightning.pytorch.strategies.DDPStrategy",
       "--trainer.strategy.broadcast_buffers=false"]
DEAD_CODE_STEPS = 3


def test_ddp_ranks_keep_identical_quantizers_and_train_on_different_windows(tmp_path):
    manifest = make_dataset(tmp_path / "data")
    dumps, windows, losses = tmp_path / "quantizers", tmp_path / "windows", tmp_path / "losses"
    out = run_lwm(manifest, tmp_path / "run", *DDP,
                  "--trainer.max_steps=12", f"--model.net.dead_code_steps={DEAD_CODE_STEPS}", "--revival.every_n_steps=1",
                  "--data.val_batch_size=2",  # validation after each batch (of 2 an epoch): 3 windows on rank 0, 2 on 1
                  "--checkpoint.every_n_train_steps=5",  # written at the end of the validation after steps 5 and 10
                  "--trainer.callbacks+=tests.lightning.helpers.DumpQuantizers", f"--trainer.callbacks.directory={dumps}",
                  "--trainer.callbacks+=tests.lightning.procs.RecordBatches", f"--trainer.callbacks.directory={windows}",
                  "--trainer.callbacks+=tests.lightning.procs.RecordLosses", f"--trainer.callbacks.directory={losses}")

    for noise in ("sync_dist=True", "broadcast_buffers", "deprecated"):  # Lightning's hints that do not apply
        assert noise not in out, out
    drawn = [json.loads((windows / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert len(drawn[0]) == len(drawn[1]) == 12 * 3
    assert drawn[0] != drawn[1], "both ranks trained on the same windows"
    # Train_* values are the ranks' mean (each rank holds as many windows), not rank 0's alone
    own = [json.loads((losses / f"rank{r}.json").read_text()) for r in (0, 1)]
    logged = {int(r["step"]): r["Train_Total/loss"] for r in read_metrics(tmp_path / "run") if "Train_Total/loss" in r}
    assert sorted(logged) == list(range(12))  # tiny logs every step
    for step, value in logged.items():
        assert math.isclose(value, (own[0][str(step)] + own[1][str(step)]) / 2, rel_tol=1e-5), (step, value, own)
    assert any(not math.isclose(value, own[0][str(step)], rel_tol=1e-5) for step, value in logged.items())

    first = [torch.load(dumps / f"first_step_rank{r}.pt", weights_only=True) for r in (0, 1)]
    for key in first[0]:  # initialised from each rank's data: rank 0's codes broadcast, then one shared EMA update
        assert torch.equal(first[0][key], first[1][key]), f"{key} differs between the ranks after the first step"
    q0, q1 = (torch.load(dumps / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert sorted(q0) == sorted(q1)
    kinds = {k.rsplit(".", 1)[-1] for k in q0}
    assert {"embed", "ema_count", "ema_sum", "unused_steps", "initialized"} <= kinds, kinds
    for key in q0:
        assert q0[key].dtype == q1[key].dtype and torch.equal(q0[key], q1[key]), f"{key} differs between the ranks"
    counts = [v for k, v in q0.items() if k.endswith("ema_count")]
    assert counts and all(not torch.equal(c, torch.ones_like(c)) for c in counts), "no EMA update happened"

    ckpt = torch.load(tmp_path / "run/checkpoints/last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 12
    for step in (5, 10):  # saved by both ranks together at a validation's end (no hang)
        assert torch.load(tmp_path / f"run/checkpoints/step={step:07d}.ckpt", weights_only=True)["global_step"] == step
    for key, value in q0.items():  # what rank 0 saved is what both ranks hold
        assert torch.equal(ckpt["state_dict"][f"model.{key}"], value), key
    assert any(k.startswith("Val_Total/loss") for r in read_metrics(tmp_path / "run") for k in r)

    # Dead-code revival (every step here): a code unused for dead_code_steps updates is replaced right after that
    # update, so no counter ends above dead_code_steps, and the identical codebooks above include the revivals.
    unused = max(int(v.max()) for k, v in q0.items() if k.endswith("unused_steps"))
    assert unused <= DEAD_CODE_STEPS, f"a code stayed unused for {unused} > {DEAD_CODE_STEPS} updates"
    revived = [r for r in read_metrics(tmp_path / "run") if any(k.startswith("Train_Action_Encoder/revived") for k in r)]
    assert revived and sum(v for r in revived for k, v in r.items() if "/revived_codes" in k) > 0


def _window_losses(ckpt_path, manifest, rank: int, world_size: int, batch_size: int) -> tuple[int, float]:
    """(windows, sum of Total/loss over them) of one rank's share of the validation set, batch by batch."""
    ckpt = torch.load(ckpt_path, weights_only=True)
    module = WorldModelModule(**ckpt["hyper_parameters"])
    module.load_state_dict(ckpt["state_dict"])
    module.eval()
    dm = LatentDataModule(str(manifest), window=6, val_batch_size=batch_size, num_workers=0)
    dm.setup("validate")
    dm._rank = lambda: (rank, world_size)  # the share `rank` of `world_size` ranks would get
    n, total = 0, 0.0
    with torch.no_grad():
        for batch in dm.val_dataloader():
            x = batch["latents"]
            total += float(module.model.compute(x, step=None, t0=0).logs["Total/loss"]) * x.shape[0]
            n += x.shape[0]
    dm.teardown("validate")
    return n, total


def test_ddp_validation_metrics_equal_one_process_on_an_uneven_split(tmp_path):
    manifest = make_dataset(tmp_path / "data", labels=True)  # val files of 16 and 18 frames: 5 windows of 6, 3 / 2
    assert run(manifest, tmp_path / "train", "--trainer.max_steps=3", "--data.val_size_percent=0") == 0
    ckpt = tmp_path / "train/checkpoints/last.ckpt"
    common = ["--data.val_batch_size=2", f"--ckpt_path={ckpt}",  # rank 0: batches of 2 and 1, rank 1: one of 2
              "--diagonality.batches=3"]  # every batch: the attention diagonality of every window, over the ranks

    # The split is uneven, and a mean of the per-rank means would be measurably wrong.
    (n0, s0), (n1, s1) = (_window_losses(ckpt, manifest, r, 2, 2) for r in (0, 1))
    assert (n0, n1) == (3, 2)
    exact, naive = (s0 + s1) / (n0 + n1), (s0 / n0 + s1 / n1) / 2
    assert abs(naive - exact) > 1e-4 * abs(exact), (naive, exact)

    assert run(manifest, tmp_path / "one", *common, verb="validate") == 0
    recorded = tmp_path / "callback_metrics"
    run_lwm(manifest, tmp_path / "two", *common, *DDP, "--trainer.callbacks+=tests.lightning.procs.RecordMetrics",
            f"--trainer.callbacks.directory={recorded}", verb="validate")
    one = [r for r in read_metrics(tmp_path / "one" / "validate") if "Val_Total/loss" in r]
    two = [r for r in read_metrics(tmp_path / "two" / "validate") if "Val_Total/loss" in r]
    assert len(one) == len(two) == 1
    one, two = one[0], two[0]
    keys = sorted(k for k in one if k.startswith("Val_"))
    assert len(keys) >= 8 and keys == sorted(k for k in two if k.startswith("Val_"))
    # The losses, the codebook coverage and (every batch here) the attention diagonality are over the whole
    # validation set, whatever the number of ranks. The sensitivities are sampled from each rank's first batch,
    # and the per-batch codebook usage depends on how the windows fall into batches: not comparable.
    keys = [k for k in keys if not any(s in k.lower() for s in ("psnr", "codebook_usage"))]
    assert {"Val_Total/loss", "Val_Action_Encoder/codebook_coverage_level_0",
            "Val_Action_Encoder/attention_diagonality_block_0/mean"} <= set(keys)
    for key in keys:
        assert math.isclose(two[key], one[key], rel_tol=1e-5, abs_tol=1e-8), (key, two[key], one[key])
    assert math.isclose(one["Val_Total/loss"], exact, rel_tol=1e-5), (one["Val_Total/loss"], exact)
    # Every rank holds every key with rank 0's value (a monitored key missing on one rank stops that rank alone at
    # its first checkpoint, and the others wait for it): the probes too, computed on rank 0 and broadcast.
    ranks = [json.loads((recorded / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert {"Val_Action_Encoder/probe_accuracy", "Val_World_Encoder/nmi"} <= set(ranks[0])
    assert ranks[1] == ranks[0]
