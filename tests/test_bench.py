"""`lwm bench` as a smoke check on the CPU (no timing is asserted: machines here are shared and noisy)."""

from __future__ import annotations

import json
import types

import pytest
import torch

from lwm.cli.main import main


@pytest.mark.slow
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


def test_bench_times_each_temporal_attention_kernel_side_by_side(monkeypatch, tmp_path):
    """``--kernels``: one fast-path row per other kernel, each step built with that kernel (the configured one
    not twice), the config's own restored for what follows."""
    import lwm.cli.bench as bench

    built = []
    real = bench.plain_step

    def plain_step(s, fast, *args, **kwargs):
        built.append((fast, s.net.temporal_attention))
        return real(s, fast, *args, **kwargs)

    monkeypatch.setattr(bench, "plain_step", plain_step)
    monkeypatch.setattr(bench, "step_times", lambda fn, steps, warmup, device: [0.5] * steps)
    out = tmp_path / "bench.json"
    argv = ["bench", "--config", "configs/tiny.yaml", "--steps", "1", "--warmup", "0", "--json", str(out),
            "--no-lightning", "--no-breakdown", "--model.net.height=16", "--model.net.width=16",
            "--data.batch_size=2", "--data.window=5", "--kernels", "matmul", "sdpa", "triton", "matmul"]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert [v["variant"] for v in result["variants"]] == [
        "reference", "fast path", "fast path (temporal_attention=matmul)", "fast path (temporal_attention=triton)"]
    assert built == [(False, "sdpa"), (True, "sdpa"), (True, "matmul"), (True, "triton")]
    assert result["net"]["temporal_attention"] == "sdpa"
    built.clear()
    assert main(["bench", "--kernels", "flash"]) == 2
    assert not built  # refused before any step is built or timed


@pytest.mark.slow
def test_a_kernel_that_fails_in_bench_keeps_the_other_rows(monkeypatch, tmp_path):
    """A kernel whose step fails (e.g. out of memory, or a compile error) becomes a note; the table and the JSON
    keep every other row."""
    import lwm.cli.bench as bench

    real = bench.plain_step

    def plain_step(s, fast, *args, **kwargs):
        if s.net.temporal_attention == "matmul":
            raise RuntimeError("CUDA error: an illegal memory access\nmore")
        return real(s, fast, *args, **kwargs)

    monkeypatch.setattr(bench, "plain_step", plain_step)
    monkeypatch.setattr(bench, "step_times", lambda fn, steps, warmup, device: [0.5] * steps)
    out = tmp_path / "bench.json"
    argv = ["bench", "--config", "configs/tiny.yaml", "--steps", "1", "--warmup", "0", "--json", str(out),
            "--no-lightning", "--no-breakdown", "--no-reference", "--model.net.height=16", "--model.net.width=16",
            "--data.batch_size=2", "--data.window=5", "--kernels", "matmul", "triton"]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert [v["variant"] for v in result["variants"]] == ["fast path", "fast path (temporal_attention=triton)"]
    assert any("temporal_attention=matmul): failed (CUDA error: an illegal memory access)" in n for n in result["notes"])
    assert result["net"]["temporal_attention"] == "sdpa"


def test_bench_refuses_bad_arguments(capsys):
    assert main(["bench", "--config", "nope.yaml"]) == 2
    assert "nope.yaml: not found" in capsys.readouterr().err
    assert main(["bench", "--config", "tiny"]) == 2
    assert "--config tiny: not found (did you mean configs/tiny.yaml?)" in capsys.readouterr().err
    assert main(["bench", "--steps", "0"]) == 2
    assert main(["bench", "stray"]) == 2
    assert "unrecognized arguments: stray" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize(("extra", "message"), [
    (["--data.batch_size=0"], "data.batch_size must be >= 1, got 0"),
    (["--data.batch_size", "0"], "data.batch_size must be >= 1, got 0"),  # the space form, as under lwm fit
    (["--data.window=2"], "data.window = 2, but the model needs at least 4 frames"),
    (["--modle.net.d_model=32"], "unrecognized arguments: --modle.net.d_model=32 (did you mean --model.net.d_model?)"),
    (["--model.net.d_model=abc"], "model.net.d_model … abc"),  # jsonargparse's line: the key and the value
    (["--model.net.n_heads=3"], "d_model must be divisible by 4 and by n_heads (3)"),
    (["--model.optim.betas=[1.5, 0.9]"], "optim.betas must be two values in [0, 1)"),
    (["--peak-tflops=-5"], "--peak-tflops must be > 0, got -5.0"),
    (["--memory-gib=0"], "--memory-gib must be > 0, got 0.0"),
    (["--batch-step=0"], "--batch-step must be >= 1, got 0"),
    (["--config", "BROKEN"], "BROKEN: Problems parsing config"),
    (["--json", "configs/tiny.yaml"], "--json configs/tiny.yaml: not a .json file name"),  # (it overwrote the config)
    (["--json", "BROKEN/out.json"], "BROKEN/out.json: cannot be created, BROKEN is not a folder (--json)"),
])
def test_bench_reads_the_config_as_fit_does_and_refuses_bad_values_in_one_line(tmp_path, capsys, extra, message):
    """The config goes through `lwm fit`'s parser and checks, before anything is timed (it ignored a misspelled
    key and failed with tracebacks on a zero batch or a short window)."""
    broken = tmp_path / "broken.yaml"
    broken.write_text("model:\n  net: [\n")
    extra = [a.replace("BROKEN", str(broken)) for a in extra]
    message = message.replace("BROKEN", str(broken))
    assert main(["bench", "--steps", "1", "--warmup", "0", *extra]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and all(part in errors[0] for part in message.split(" … ")), errors


def test_largest_batch_search_finds_the_boundary_with_few_trials():
    from lwm.cli.bench import largest_batch

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


def test_largest_batch_search_to_a_step_stops_within_it_with_fewer_trials():
    """--batch-step: the batch found is at most step - 1 below the largest that fits, never above it, and the
    search stops bisecting there (each trial compiles anew on a GPU)."""
    from lwm.cli.bench import largest_batch

    for largest in (32, 33, 39, 40, 47, 63, 64, 100):
        exact, coarse = [], []
        assert largest_batch(lambda b: exact.append(b) or b <= largest, start=32, limit=4096) == largest
        found = largest_batch(lambda b: coarse.append(b) or b <= largest, start=32, limit=4096, step=8)
        assert largest - 7 <= found <= largest, (largest, found)
        assert len(coarse) <= len(exact) - 2 or len(exact) <= 3, (largest, exact, coarse)
    assert largest_batch(lambda b: b <= 45, start=32, limit=4096, step=8) in range(38, 46)


def test_max_batch_holds_the_process_to_memory_gib_and_lets_go_after(monkeypatch):
    """--memory-gib 80 on a 139 GiB card: the search runs with the process held to 80/139 of it (an 80 GB card's
    answer on an H200), released afterwards; a cap above the card's memory holds nothing."""
    import types

    import torch
    from rich.console import Console

    import lwm.cli.bench as bench

    fractions = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=139 * 2**30))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: fractions.append(round(f, 4)))
    seen = []

    def fits_on_gpu(s):
        return lambda b: seen.append(fractions[-1] if fractions else None) or b <= 40

    monkeypatch.setattr(bench, "fits_on_gpu", fits_on_gpu)
    s = types.SimpleNamespace(device=torch.device("cuda"), batch=32, patches=256, window=16)
    console = Console(file=open("/dev/null", "w"))
    assert bench.run_max_batch(s, console, lambda text: None, memory_gib=80, step=8) in range(33, 41)
    assert set(seen) == {round(80 / 139, 4)} and fractions[-1] == 1.0
    fractions.clear(), seen.clear()
    assert bench.run_max_batch(s, console, lambda text: None, memory_gib=200) == 40
    assert fractions == [1.0] and set(seen) == {None}  # never held (only the release after)


@pytest.mark.slow
def test_step_flops_are_linear_in_the_batch_and_leave_out_checkpointing_recompute():
    """The bench and the flop counter count one sample's step and multiply by the batch: an identity for every
    counted op (matmuls, convolutions, attention, codebook distances); activation checkpointing's recomputed
    forward is not counted."""
    import torch

    from lwm.cli.bench import Setup, step_flops
    from lwm.modules.flops import count_flops
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

    from lwm.cli.bench import runs_on_gpu

    def failing(error):
        def step():
            raise error
        return lambda: step

    assert runs_on_gpu(lambda: (lambda: None), calls=2)
    assert not runs_on_gpu(failing(torch.OutOfMemoryError("CUDA out of memory")))
    assert not runs_on_gpu(failing(RuntimeError("CUDA error: invalid configuration argument")))
    with pytest.raises(RuntimeError, match="a bug"):
        runs_on_gpu(failing(RuntimeError("a bug")))


def test_timed_leaves_the_warmup_out_and_averages_over_the_timed_steps(monkeypatch):
    import lwm.cli.bench as bench

    clock = {"t": 0.0, "calls": 0}

    def fn():  # warm-up calls cost 100 s each, timed ones 1 s
        clock["t"] += 100.0 if clock["calls"] < 2 else 1.0
        clock["calls"] += 1

    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: clock["t"]))
    assert bench.timed(fn, steps=4, warmup=2, device=torch.device("cpu")) == 1.0
    assert clock["calls"] == 6


def test_step_times_are_each_timed_step_after_the_warmup(monkeypatch):
    import lwm.cli.bench as bench

    clock = {"t": 0.0, "calls": 0}

    def fn():  # 2 warm-up calls of 100 s, then 1, 2, 3 s
        clock["calls"] += 1
        clock["t"] += 100.0 if clock["calls"] <= 2 else clock["calls"] - 2.0

    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: clock["t"]))
    assert bench.step_times(fn, steps=3, warmup=2, device=torch.device("cpu")) == [1.0, 2.0, 3.0]
    assert clock["calls"] == 5


@pytest.mark.slow
def test_bench_reports_each_variants_spread_and_warns_when_the_timings_are_noisy(monkeypatch, tmp_path, capsys):
    """The case a user met on a busy machine: one fast-path step slowed 19x by another process made its mean larger
    than Lightning's and the overhead negative. The median, min and max of the timed steps are in the table and the
    JSON; the speed-ups and the overhead are of the medians, and a one-line warning says the timings are noisy."""
    import lwm.cli.bench as bench

    times = iter([[1.0, 1.2, 1.1], [0.4, 7.6, 0.5]])  # the reference, then the fast path (seconds per step)
    monkeypatch.setattr(bench, "step_times", lambda fn, steps, warmup, device: next(times))
    monkeypatch.setattr(bench, "lightning_step_times", lambda s, steps, warmup: [0.7, 0.6, 0.65])
    monkeypatch.setattr(bench, "matmul_tflops", lambda device: (4.0, "fake"))
    out = tmp_path / "bench.json"
    argv = ["bench", "--config", "configs/tiny.yaml", "--steps", "3", "--warmup", "1", "--json", str(out),
            "--no-breakdown", "--model.net.height=16", "--model.net.width=16", "--data.batch_size=2",
            "--data.window=5"]
    assert main(argv) == 0
    r = json.loads(out.read_text())
    v = {row["variant"]: row for row in r["variants"]}
    assert v["fast path"]["ms_steps"] == pytest.approx([400.0, 7600.0, 500.0])
    for label, mean, median, low, high in (("reference", 1100.0, 1100.0, 1000.0, 1200.0),
                                           ("fast path", 2833.333, 500.0, 400.0, 7600.0),
                                           ("lightning", 650.0, 650.0, 600.0, 700.0)):
        row = v[label]
        assert (row["ms_per_step"], row["ms_median"], row["ms_min"], row["ms_max"]) == pytest.approx(
            (mean, median, low, high)), label
        assert row["max_over_min"] == pytest.approx(high / low)
        assert row["steps_per_s"] == pytest.approx(1e3 / mean)  # the rates: of the mean
        assert row["speedup"] == pytest.approx(1100.0 / median)  # the ratios: of the medians
    assert r["lightning_overhead_ms"] == pytest.approx(150.0)  # of the medians (the means give -2183.3)
    warning = ("warning: the timings are noisy (fast path: slowest step 19.00x the fastest): another process is "
               "probably competing for the device or the CPU; rerun on a quiet machine (more --steps steady the "
               "medians)")
    assert r["noise_warning"] == warning
    printed = capsys.readouterr().out
    assert warning in printed.splitlines()  # one line
    assert "Lightning overhead: +150.0 ms/step (medians)" in printed
    table = next(line for line in printed.splitlines() if line.startswith("│ fast path"))
    assert [cell.strip() for cell in table.split("│")[2:6]] == ["2833.3", "500.0", "400.0", "7600.0"]


@pytest.mark.parametrize(("medians", "spreads", "expected"), [
    ({"fast path": 650.0, "lightning": 640.0}, (1.0, 1.5), "(Lightning overhead -10.0 ms/step < 0)"),
    ({"fast path": 600.0, "lightning": 650.0}, (1.51, 1.0), "(fast path: slowest step 1.51x the fastest)"),
    ({"fast path": 600.0, "lightning": 550.0}, (2.0, 3.0), "(Lightning overhead -50.0 ms/step < 0; fast path: "
                                                             "slowest step 2.00x the fastest; lightning: slowest step "
                                                             "3.00x the fastest)"),
    ({"fast path": 600.0, "lightning": 650.0}, (1.5, 1.5), None),  # at most 1.5x, and a positive overhead: quiet
    ({"fast path": 600.0}, (1.0, None), None),  # Lightning not measured
])
def test_the_noise_warning_names_each_reason(medians, spreads, expected):
    from lwm.cli.bench import lightning_overhead_ms, noise_warning

    rows = [{"variant": k, "ms_median": m, "max_over_min": spread} for (k, m), spread in zip(medians.items(), spreads)]
    overhead = lightning_overhead_ms(rows)
    assert overhead == (medians["lightning"] - medians["fast path"] if "lightning" in medians else None)
    warning = noise_warning(rows, overhead)
    if expected is None:
        assert warning is None
    else:
        assert warning.startswith(f"warning: the timings are noisy {expected}: another process") and "\n" not in warning
        # without warm-up steps the first timed step paid for compilation: that is named as the cause
        assert noise_warning(rows, overhead, warmup=0) == (f"warning: the timings are noisy {expected}: with --warmup 0 "
                                                           "the first timed step pays for compilation and first-call "
                                                           "allocations; rerun with --warmup 1 or more")


def test_the_matmul_roofline_counts_two_flops_per_multiply_add(monkeypatch):
    import lwm.cli.bench as bench

    monkeypatch.setattr(bench, "timed", lambda fn, steps, warmup, device: 0.5)
    tflops, what = bench.matmul_tflops(torch.device("cpu"))
    assert tflops == pytest.approx(2 * 2048**3 / 0.5 / 1e12) and what == "float32 2048^3"


@pytest.mark.slow
def test_bench_numbers_follow_from_the_step_times_and_flops(monkeypatch, tmp_path, capsys):
    """With every timer replaced (0.5 s a fast/reference step and a breakdown part, 2 s a Lightning step, a 4 TFLOP/s
    matmul), each number in the JSON is a known function of the others."""
    import lwm.cli.bench as bench

    monkeypatch.setattr(bench, "step_times", lambda fn, steps, warmup, device: [0.5] * steps)
    monkeypatch.setattr(bench, "lightning_step_times", lambda s, steps, warmup: [2.0] * steps)
    monkeypatch.setattr(bench, "matmul_tflops", lambda device: (4.0, "fake"))
    out = tmp_path / "bench.json"
    B, T = 2, 5
    argv = ["bench", "--config", "configs/tiny.yaml", "--steps", "1", "--warmup", "0", "--json", str(out),
            "--peak-tflops", "10", "--model.net.height=16", "--model.net.width=32",  # 4 x 8 = 32 patches
            f"--data.batch_size={B}", f"--data.window={T}"]
    assert main(argv) == 0
    r = json.loads(out.read_text())
    assert r["peak_tflop_per_s"] == 10 and r["matmul_tflop_per_s"] == 4.0
    seconds = {"reference": 0.5, "fast path": 0.5, "lightning": 2.0}
    assert [v["variant"] for v in r["variants"]] == list(seconds)
    for v in r["variants"]:
        s = seconds[v["variant"]]
        tflop = r["flops_useful"] / s / 1e12
        assert v["ms_per_step"] == pytest.approx(s * 1e3)
        assert v["steps_per_s"] == pytest.approx(1 / s)
        assert v["frames_per_s"] == pytest.approx(B * T / s)
        assert v["tokens_per_s"] == pytest.approx(B * T * 32 / s)
        assert v["tflop_per_s"] == pytest.approx(tflop)  # the useful FLOPs, not the dense ones
        assert v["mfu_peak"] == pytest.approx(tflop / 10)
        assert v["mfu_matmul"] == pytest.approx(tflop / 4.0)
        assert v["speedup"] == pytest.approx(0.5 / s)  # reference time / this variant's time
        assert v["ms_median"] == v["ms_min"] == v["ms_max"] == v["ms_per_step"] and v["max_over_min"] == 1.0
    assert r["lightning_overhead_ms"] == pytest.approx(1500.0) and r["noise_warning"] is None
    printed = capsys.readouterr().out
    assert "Lightning overhead: +1500.0 ms/step" in printed and "timings are noisy" not in printed
    # 0.5 s for every part alone and for the whole eager step: the parts sum to more than the step, said
    assert "the breakdown is noisy (the parts alone took" in printed
    parts = r["breakdown"]
    timed_parts = parts[:-1]
    assert parts[-1]["part"].startswith("other")
    for p in timed_parts:  # 0.5 s per call: every call of every block counted (depth x passes)
        assert p["ms"] == pytest.approx(500 * p["calls"]), p
    assert any(p["calls"] > 1 for p in timed_parts if "MLP" in p["part"])  # depth 2 at tiny
    assert parts[-1]["ms"] == pytest.approx(500 - sum(p["ms"] for p in timed_parts))  # the eager step (0.5 s) minus
    # what each rollout pass adds: the steps with 1, 2, 3 passes all 0.5 s here, so all but teacher forcing add
    # nothing; their FLOPs add up to the whole step's
    passes = r["passes"]
    assert [p["part"] for p in passes] == ["teacher forcing (and all else)", "+ rollout pass 1", "+ rollout pass 2"]
    assert [p["ms"] for p in passes] == pytest.approx([500, 0, 0]) and [p["step_ms"] for p in passes] == [500] * 3
    assert all(p["tflop"] > 0 for p in passes)
    assert sum(p["tflop"] for p in passes) * 1e12 == pytest.approx(r["flops_useful"], rel=1e-9)


@pytest.mark.slow
def test_a_variant_that_fails_keeps_the_earlier_ones_in_the_json(monkeypatch, tmp_path, capsys):
    """The JSON is written after each variant: a later one that fails (or a stage cut off by its time limit) keeps
    what was measured; each variant's median is printed as it is measured."""
    import lwm.cli.bench as bench

    def killed(s, steps, warmup):
        raise RuntimeError("killed")

    monkeypatch.setattr(bench, "step_times", lambda fn, steps, warmup, device: [0.5] * steps)
    monkeypatch.setattr(bench, "lightning_step_times", killed)
    out = tmp_path / "bench.json"
    argv = ["bench", "--config", "configs/tiny.yaml", "--steps", "1", "--warmup", "0", "--json", str(out),
            "--model.net.height=16", "--model.net.width=16", "--data.batch_size=2", "--data.window=5"]
    with pytest.raises(RuntimeError, match="killed"):
        main(argv)
    r = json.loads(out.read_text())
    assert [v["variant"] for v in r["variants"]] == ["reference", "fast path"]
    assert r["variants"][1]["ms_median"] == 500.0 and r["variants"][1]["speedup"] == 1.0
    assert "fast path: 500.0 ms/step (median), 20 frames/s" in capsys.readouterr().out


@pytest.mark.slow
def test_breakdown_counts_useful_attention_flops(monkeypatch):
    """A part's FLOPs are its useful ones: the temporal attention counts fewer than PyTorch's dense count of the
    same calls (no recomputed scores in the backward), the causal one of the dynamics predictor fewer still."""
    import lwm.cli.bench as bench
    import lwm.modules.flops as flops

    monkeypatch.setattr(bench, "timed", lambda fn, steps, warmup, device: 0.5)
    cfg = {"model": {"net": {"in_channels": 4, "height": 8, "width": 8, "d_model": 32, "n_heads": 2,
                             "depth_action": 1, "depth_world": 1, "depth_dynamics": 1, "d_code_action": 8,
                             "d_code_world": 8, "codebook_sizes_action": [4], "codebook_sizes_world": [4]}},
           "data": {"batch_size": 2, "window": 5}}
    s = bench.Setup(cfg, torch.device("cpu"))
    useful = {r["part"]: r["tflop"] for r in bench.breakdown(s, 1, 0)}
    real = flops.count_flops
    monkeypatch.setattr(bench, "count_flops", lambda fn: (lambda f: flops.StepFlops(f.dense, f.dense))(real(fn)))
    dense = {r["part"]: r["tflop"] for r in bench.breakdown(s, 1, 0)}
    causal, unmasked = "dynamics: temporal attention", "world encoder: temporal attention"
    assert 0 < useful[unmasked] < dense[unmasked]  # without the backward's recomputed scores
    assert 0 < useful[causal] / dense[causal] < useful[unmasked] / dense[unmasked]  # and the masked pairs


def test_lightning_timing_starts_after_the_warmup(monkeypatch):
    """Each step timed from its batch start to the next, from batch ``warmup`` to batch ``warmup + steps``: with a
    clock that reads the square of the number of training steps run so far, 2^2..5^2 at those starts."""
    import lwm.cli.bench as bench
    from lwm.training.module import WorldModelModule

    done = {"n": 0}
    original = WorldModelModule.training_step

    def training_step(self, *args, **kwargs):
        done["n"] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(WorldModelModule, "training_step", training_step)
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: float(done["n"] ** 2)))
    cfg = {"model": {"net": {"in_channels": 4, "height": 8, "width": 8, "d_model": 16, "n_heads": 2,
                             "depth_action": 1, "depth_world": 1, "depth_dynamics": 1, "d_code_action": 4,
                             "d_code_world": 4, "codebook_sizes_action": [4], "codebook_sizes_world": [4]}},
           "data": {"batch_size": 2, "window": 5}}
    s = bench.Setup(cfg, torch.device("cpu"))
    assert bench.lightning_step_times(s, steps=3, warmup=2) == [9.0 - 4.0, 16.0 - 9.0, 25.0 - 16.0]


def _setup(**net):
    from lwm.cli.bench import Setup

    cfg = {"model": {"net": {"in_channels": 4, "height": 8, "width": 8, "d_model": 16, "n_heads": 2,
                             "depth_action": 1, "depth_world": 1, "depth_dynamics": 1, "d_code_action": 4,
                             "d_code_world": 4, "codebook_sizes_action": [4], "codebook_sizes_world": [4], **net}},
           "data": {"batch_size": 3, "window": 5}, "trainer": {"precision": "bf16-mixed"}}
    return Setup(cfg, torch.device("cpu"))


def test_the_reference_is_the_plain_model_eager_fp32_for_loop_adamw_recomputing_every_pass(monkeypatch):
    from lwm.cli.bench import plain_step, reference_net

    s = _setup(activation_checkpointing=True, temporal_attention="matmul")
    ref = reference_net(s)
    assert ref.activation_checkpointing is False and ref.temporal_attention == "sdpa"
    seen = {}
    for fast in (False, True):
        step, model, opt = plain_step(s, fast=fast)
        original = model.compute

        def compute(x, step_, *a, fast=fast, original=original, **kw):
            seen[fast] = (torch.is_autocast_enabled("cpu"), kw.get("reuse_prefix"))
            return original(x, step_, *a, **kw)

        model.compute = compute
        step()
        if not fast:
            assert opt.defaults["foreach"] is False  # the for-loop AdamW
    assert seen[False] == (False, False)  # the reference: fp32, every position of every pass recomputed
    assert seen[True] == (True, True)  # the fast path: the config's bf16 autocast, prefix reused


def test_micro_batches_weight_each_chunk_by_its_share_of_the_batch(monkeypatch):
    """Batch 3 in 2 micro-batches (2 + 1 samples): the accumulated gradient is that of the batch mean."""
    from lwm.cli.bench import plain_step

    s = _setup()
    grads = {}
    for micro in (1, 2):
        step, model, opt = plain_step(s, fast=False, micro=micro)
        p = next(model.parameters())
        model.compute = lambda x, *a, p=p, **kw: types.SimpleNamespace(loss=p.sum() * x.mean())
        opt.step = lambda micro=micro, p=p: grads.__setitem__(micro, p.grad.clone())
        step()
    assert torch.allclose(grads[2], grads[1]) and torch.allclose(grads[1], torch.full_like(grads[1], float(s.x.mean())))


def test_the_fit_probe_leaves_the_setups_batch_alone(monkeypatch):
    import lwm.cli.bench as bench

    s = _setup()
    x = s.x
    monkeypatch.setattr(bench, "runs_on_gpu", lambda make, calls=1: make() is not None)
    assert bench.fits_on_gpu(s)(7)
    assert s.x is x


@pytest.mark.slow
def test_each_compiled_variant_compiles_from_fresh_caches(monkeypatch, tmp_path):
    """A review found every compiled variant (the fast path, each --kernels row, the Lightning step) adding dynamo
    cache entries to the same code objects, about three each in ``DynamicsPredictor.forward`` (one per rollout
    pass), until ``config.recompile_limit`` (8) was hit on the third and a rollout pass ran uncompiled in its timed
    steps. Compiled here on the CPU with dynamo's eager backend (the same cache entries, without inductor's
    compile time) and the limit at 4, so that two variants' entries exceed it: each variant compiles the same
    graphs from fresh caches, dynamo hits no limit, and the JSON says so per variant."""
    import lwm.cli.bench as bench
    from torch._dynamo.utils import counters

    from lwm.modules.world_model import WorldModel

    real_init, real_compile = bench.Setup.__init__, WorldModel.compile_parts

    def init(self, cfg, device):
        real_init(self, cfg, device)
        self.compile = True  # model.compile, on the CPU too

    monkeypatch.setattr(bench.Setup, "__init__", init)
    monkeypatch.setattr(WorldModel, "compile_parts", lambda self, **kwargs: real_compile(self, backend="eager"))

    def hits() -> int:  # dynamo's own count, whatever lwm bench records
        return sum(n for message, n in counters["unimplemented"].items() if "recompile limit" in message)

    before = hits()
    out = tmp_path / "bench.json"
    argv = ["bench", "--config", "configs/tiny.yaml", "--steps", "1", "--warmup", "1", "--json", str(out),
            "--no-breakdown", "--no-reference", "--model.net.height=16", "--model.net.width=16",
            "--data.batch_size=2", "--data.window=5", "--kernels", "matmul"]
    try:
        with torch._dynamo.config.patch(recompile_limit=4):  # (monkeypatch would delete it from the config)
            assert main(argv) == 0
    finally:
        torch._dynamo.reset()  # no compiled caches left to later tests
    assert hits() == before
    result = json.loads(out.read_text())
    dynamo = {v["variant"]: v["dynamo"] for v in result["variants"]}
    assert list(dynamo) == ["fast path", "fast path (temporal_attention=matmul)", "lightning"]
    graphs = dynamo["fast path"]["graphs"]
    for d in dynamo.values():
        assert d == {"graphs": graphs, "recompile_limit_hits": 0, "recompile_limit_functions": [], "graph_breaks": {},
                     "unsupported": {}, "compiles_in_timed_steps": 0}
    assert graphs > 0 and not any("dynamo" in note for note in result["notes"])


def test_the_dynamo_watch_records_recompile_limit_hits_graph_breaks_and_compiles_in_timed_steps():
    """What makes a compiled row mis-measured is counted and named in a note: a function past its recompile limit
    (from then on uncompiled for new shapes), a graph break, a compilation between the timed steps' first and last
    marks."""
    from lwm.cli.bench import StepClock
    from lwm.cli.dynamo_watch import DynamoWatch, dynamo_note

    def scaled(x):
        return x * 2

    def broken(x):
        x = x + 1
        torch._dynamo.graph_break()
        return x - 1

    compiled = torch.compile(scaled, backend="eager", dynamic=False)
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(recompile_limit=1), DynamoWatch.watching() as watch:
            compiled(torch.ones(2))
            compiled(torch.ones(3))  # a second shape: past the limit of 1, runs uncompiled
        d = watch.result()
        assert d["graphs"] == 1 and d["recompile_limit_hits"] == 1 and d["compiles_in_timed_steps"] is None
        assert d["recompile_limit_functions"] == [
            f"'scaled' (tests/test_bench.py:{scaled.__code__.co_firstlineno}) (recompile_limit 1)"]
        note = dynamo_note("fast path", d)
        assert note.startswith("fast path: dynamo: hit its recompile limit 1 time(s) in 'scaled' (tests/test_bench.py")
        assert note.endswith("this row is mis-measured")

        with DynamoWatch.watching() as watch:
            clock = StepClock(torch.device("cpu"))
            torch.compile(broken, backend="eager")(torch.ones(2))
            clock.mark()  # the timed steps start
            torch.compile(lambda x: x - 3, backend="eager")(torch.ones(2))
            clock.mark()  # ... and end
            torch.compile(lambda x: x + 5, backend="eager")(torch.ones(2))  # after them (an untimed batch): not counted
        d = watch.result()
        assert d["recompile_limit_hits"] == 0 and sum(d["graph_breaks"].values()) == 1
        assert d["compiles_in_timed_steps"] == 1 and d["graphs"] == 4
        note = dynamo_note("x", d)
        assert "1 graph break(s)" in note and "1 compilation(s) during the timed steps" in note
        assert DynamoWatch.active is None
        with DynamoWatch.watching() as watch:  # nothing compiled: nothing to say
            scaled(torch.ones(2))
        assert dynamo_note("reference", watch.result()) is None
    finally:
        torch._dynamo.reset()


def test_host_syncs_are_listed_by_place_with_counts():
    """Each host sync's ``file:line`` (relative to the repository or site-packages) and count, not only the
    message, which is the same for all ("called a synchronizing CUDA operation")."""
    import warnings

    from lwm.cli.bench import ROOT, sync_count, sync_sites

    def caught(message, filename, lineno):
        return warnings.WarningMessage(UserWarning(message), UserWarning, filename, lineno)

    sync = "called a synchronizing CUDA operation (Triggered internally at ...)\nmore"
    warned = [caught(sync, str(ROOT / "lwm/modules/vq.py"), 120),
              caught("an unrelated warning", str(ROOT / "lwm/module.py"), 5),
              caught(sync, "/usr/lib/python3/site-packages/torch/nn/utils/clip_grad.py", 88),
              caught(sync, str(ROOT / "lwm/modules/vq.py"), 120)]
    sites = sync_sites(warned)
    message = "called a synchronizing CUDA operation (Triggered internally at ...)"
    assert sites == [{"where": "lwm/modules/vq.py:120", "message": message, "count": 2},
                     {"where": "torch/nn/utils/clip_grad.py:88", "message": message, "count": 1}]
    assert sync_count(sites) == "3 (at 2 places)" and sync_count([]) == "0"


@pytest.mark.slow
def test_rollout_passes_time_a_config_whose_first_weights_are_zero(monkeypatch, tmp_path):
    """rollout_weights [0, 1] is valid (teacher forcing unweighted), but its first pass alone, [0], is not: the
    per-pass steps keep every pass's weight positive (each pass is computed whatever its weight)."""
    import lwm.cli.bench as bench

    monkeypatch.setattr(bench, "step_times", lambda fn, steps, warmup, device: [0.5] * steps)
    out = tmp_path / "bench.json"
    argv = ["bench", "--config", "configs/tiny.yaml", "--steps", "1", "--warmup", "0", "--json", str(out),
            "--no-reference", "--no-lightning", "--model.net.height=16", "--model.net.width=16",
            "--data.batch_size=2", "--data.window=5", "--model.net.rollout_weights=[0.0, 1.0]"]
    assert main(argv) == 0
    r = json.loads(out.read_text())
    assert [p["part"] for p in r["passes"]] == ["teacher forcing (and all else)", "+ rollout pass 1"]
    assert sum(p["tflop"] for p in r["passes"]) * 1e12 == pytest.approx(r["flops_useful"], rel=1e-9)
    assert r["net"]["rollout_weights"] == [0.0, 1.0] and r["breakdown"]
