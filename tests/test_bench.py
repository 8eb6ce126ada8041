"""`lwm bench` as a smoke check on the CPU (no timing is asserted: machines here are shared and noisy)."""

from __future__ import annotations

import json

import pytest

from lwm.cli import main


def test_bench_runs_at_tiny_and_writes_every_number(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "--config", "configs/tiny.yaml", "--steps", "1", "--warmup", "0", "--json", str(out),
            "--model.net.height=16", "--model.net.width=16", "--data.batch_size=2", "--data.window=5"]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert [v["variant"] for v in result["variants"]] == ["reference", "fast path", "lightning"]
    assert result["variants"][0]["speedup"] == 1.0  # every ratio is to the reference
    for v in result["variants"]:
        assert v["ms_per_step"] > 0 and v["frames_per_s"] == pytest.approx(2 * 5 / (v["ms_per_step"] / 1e3))
        assert v["tokens_per_s"] == pytest.approx(v["frames_per_s"] * 16)  # 16x16 latents: 4x4 patches
    # causal and shifted-causal temporal attention: fewer useful than dense FLOPs; the module breakdown adds up
    assert 0 < result["flops_useful"] < result["flops_dense"]
    assert sum(result["flops_by_op"].values()) == result["flops_useful"]
    parts = {r["part"] for r in result["breakdown"]}
    assert {"tokenizer", "detokenizer", "dynamics: temporal attention", "quantizers (with EMA update)", "optimizer",
            "action encoder: temporal attention (shifted_causal)", "action encoder: temporal attention (causal)"} <= parts
    assert result["host_syncs"] is None and result["max_batch"] is None  # a GPU's numbers
    assert "training step" in capsys.readouterr().out


def test_bench_refuses_bad_arguments(capsys):
    assert main(["bench", "--config", "nope.yaml"]) == 2
    assert "nope.yaml: not found" in capsys.readouterr().err
    assert main(["bench", "--steps", "0"]) == 2
    assert main(["bench", "stray"]) == 2
    assert "unknown argument(s) stray" in capsys.readouterr().err


def test_largest_batch_search_finds_the_boundary_with_few_trials():
    from lwm.bench import largest_batch

    for limit_that_fits in (1, 2, 3, 37, 64, 100, 1000):
        tried = []

        def fits(b: int) -> bool:
            tried.append(b)
            return b <= limit_that_fits

        assert largest_batch(fits, start=1, limit=4096) == limit_that_fits
        assert len(tried) <= 2 * 12 + 1  # doubling, then bisecting
    assert largest_batch(lambda b: False, start=8) == 0
    assert largest_batch(lambda b: True, start=8, limit=100) == 100
    assert largest_batch(lambda b: b <= 50, start=32, limit=4096) == 50


def test_step_flops_are_linear_in_the_batch_and_leave_out_checkpointing_recompute():
    """The bench and the flop counter count one sample's step and multiply by the batch: an identity for every
    counted op (matmuls, convolutions, attention, codebook distances); activation checkpointing's recomputed
    forward is not counted."""
    import torch

    from lwm.bench import Setup, step_flops
    from lwm.flops import count_flops
    from lwm.modules.world_model import WorldModel

    cfg = {"model": {"net": {"in_channels": 4, "height": 8, "width": 8, "d_model": 32, "n_heads": 2,
                             "d_code_action": 8, "d_code_world": 8, "codebook_sizes_action": [4, 8],
                             "codebook_sizes_world": [4, 8]}},
           "data": {"batch_size": 3, "window": 5}}
    s = Setup(cfg, torch.device("cpu"))
    model = WorldModel(s.net).train()

    def full_batch() -> None:
        model.compute(s.x, step=None, generator=torch.Generator().manual_seed(0)).loss.backward()

    assert step_flops(s).useful == count_flops(full_batch, dense=False).useful
    cfg["model"]["net"]["activation_checkpointing"] = True
    checkpointed = Setup(cfg, torch.device("cpu"))
    assert step_flops(checkpointed).useful == step_flops(s).useful
    model = WorldModel(checkpointed.net).train()
    with model.checkpointing(False):
        plain = count_flops(lambda: model.compute(s.x, step=None).loss.backward(), dense=False).useful
    assert model.dynamics.transformer.checkpointing  # restored
    assert count_flops(lambda: model.compute(s.x, step=None).loss.backward(), dense=False).useful > plain


def test_a_step_that_runs_out_of_memory_does_not_fit_and_other_errors_surface():
    import torch

    from lwm.bench import runs_on_gpu

    def failing(error):
        def step():
            raise error
        return lambda: step

    assert runs_on_gpu(lambda: (lambda: None), calls=2)
    assert not runs_on_gpu(failing(torch.OutOfMemoryError("CUDA out of memory")))
    assert not runs_on_gpu(failing(RuntimeError("CUDA error: invalid configuration argument")))
    with pytest.raises(RuntimeError, match="a bug"):
        runs_on_gpu(failing(RuntimeError("a bug")))
