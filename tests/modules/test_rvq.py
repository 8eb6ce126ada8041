"""Tests of the residual vector quantizer (lwm/modules/rvq.py): identities and known answers, all tiny and CPU."""

import copy
import io
import os
import socket
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lwm.modules.rvq import ResidualVectorQuantizer, _distinct_rows

FLOAT_BUFFERS = ("embed", "ema_count", "ema_sum")


def rvq(dim=4, sizes=(4, 8), seed=0, **kw) -> ResidualVectorQuantizer:
    torch.manual_seed(seed)
    kw.setdefault("init_from_data", False)
    return ResidualVectorQuantizer(dim, sizes, **kw)


def snapshot(module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_states_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


def set_codes(q: ResidualVectorQuantizer, level: int, codes: torch.Tensor) -> None:
    """Known codebook with the documented fresh EMA state (N=1, M=e)."""
    cb = q.levels[level]
    cb.embed.copy_(codes)
    cb.ema_sum.copy_(codes)
    cb.ema_count.fill_(1.0)
    cb.unused_steps.zero_()


def is_row_of(rows: torch.Tensor, pool: torch.Tensor, atol: float = 1e-6) -> torch.Tensor:
    """[n] bool: each row of ``rows`` equals some row of ``pool``."""
    return ((rows[:, None, :] - pool[None, :, :]).abs() <= atol).all(-1).any(-1)


# --------------------------------------------------------------------------------------------------
# 1. decode_indices(indices) == quantized, shapes and dtypes
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sizes", [(12, 64, 256), (12, 24, 48, 256, 256, 256)])
@pytest.mark.parametrize("lead", [(2, 5), (3,)])
def test_decode_indices_reproduces_quantized(sizes, lead):
    dim = 8
    q = rvq(dim, sizes).eval()
    before = snapshot(q)
    z = torch.randn(*lead, dim)
    out = q(z, step=3)  # eval mode: a step is given but nothing is updated
    assert out.quantized.shape == (*lead, dim) and out.quantized.dtype == torch.float32
    assert out.indices.shape == (*lead, len(sizes)) and out.indices.dtype == torch.int64
    for level, k in enumerate(sizes):
        assert 0 <= int(out.indices[..., level].min()) and int(out.indices[..., level].max()) < k
    decoded = q.decode_indices(out.indices)
    assert decoded.shape == (*lead, dim)
    # no gradient asked for: the code itself, bit for bit (a replay of recorded indices plays the same frames)
    assert torch.equal(decoded, out.quantized)
    # and it is the sum of the chosen codes of every level
    expected = sum(q.codebook(l)[out.indices[..., l]] for l in range(len(sizes)))
    assert torch.equal(decoded, expected)
    # with a gradient, the straight-through output z + (q - z), which may differ from q by float32 rounding only
    out_st = q(z.clone().requires_grad_(), step=3)
    assert torch.equal(out_st.indices, out.indices) and out_st.quantized.requires_grad
    torch.testing.assert_close(out_st.quantized, decoded, rtol=0, atol=1e-6)
    assert_states_equal(before, snapshot(q))


def test_no_update_without_step_or_in_eval():
    q = rvq(4, (4, 8))
    before = snapshot(q)
    z = torch.randn(16, 4)
    q.train()(z)  # training mode, no step: no update
    q.eval()(z, step=5)  # eval mode with a step: no update
    assert_states_equal(before, snapshot(q))
    q.train()(z, step=5)
    assert not torch.equal(before["levels.0.embed"], q.codebook(0))


# --------------------------------------------------------------------------------------------------
# 2. nearest code at every level
# --------------------------------------------------------------------------------------------------
def test_indices_are_nearest_codes_of_each_residual():
    dim, sizes = 6, (8, 16, 32)
    q = rvq(dim, sizes, seed=1).eval()
    z = torch.randn(4, 10, dim, generator=torch.Generator().manual_seed(11))
    out = q(z)
    idx = out.indices.reshape(-1, len(sizes))
    r = z.reshape(-1, dim).double()
    for level in range(len(sizes)):
        codes = q.codebook(level).double()
        d2 = torch.cdist(r, codes) ** 2  # [M, K]
        loop = torch.tensor([min(range(codes.shape[0]), key=lambda k: float(((row - codes[k]) ** 2).sum())) for row in r])
        assert torch.equal(d2.argmin(-1), loop)
        assert torch.equal(idx[:, level], loop), f"level {level}"
        r = r - codes[loop]


# --------------------------------------------------------------------------------------------------
# 3. EMA update against a numpy float64 reference over several steps
# --------------------------------------------------------------------------------------------------
def numpy_rvq_ema(codebooks, batches, steps, decay_start, decay_end, decay_steps, eps, dead_code_steps):
    E = [np.array(c, dtype=np.float64) for c in codebooks]
    N = [np.ones(c.shape[0]) for c in E]
    M = [c.copy() for c in E]
    U = [np.zeros(c.shape[0], dtype=np.int64) for c in E]
    for x, s in zip(batches, steps):
        g = float(np.interp(float(s), [0.0, float(decay_steps)], [decay_start, decay_end]))  # clamps outside
        r = np.asarray(x, dtype=np.float64).reshape(-1, E[0].shape[1])
        for l in range(len(E)):
            d2 = ((r[:, None, :] - E[l][None, :, :]) ** 2).sum(-1)
            k = d2.argmin(1)
            n = np.bincount(k, minlength=E[l].shape[0]).astype(np.float64)
            ssum = np.zeros_like(E[l])
            np.add.at(ssum, k, r)
            qv = E[l][k]  # this level's code before its update
            N[l] = g * N[l] + (1 - g) * n
            M[l] = g * M[l] + (1 - g) * ssum
            E[l] = M[l] / (N[l][:, None] + eps)
            U[l] = np.where(n > 0, 0, U[l] + 1)
            r = r - qv
    return E, N, M, U


def test_ema_update_matches_numpy_reference(monkeypatch):
    def no_bincount(*args, **kwargs):  # it reads the indices' min and max on the host: a sync per call on CUDA
        raise AssertionError("torch.bincount in the EMA update")

    monkeypatch.setattr(torch, "bincount", no_bincount)
    dim, sizes = 4, (4, 6, 8)
    cfg = dict(decay_start=0.5, decay_end=0.9, decay_steps=10, eps=1e-5, dead_code_steps=3)
    q = rvq(dim, sizes, seed=2, **cfg).train()
    codebooks = [q.codebook(l).numpy().copy() for l in range(len(sizes))]
    g = torch.Generator().manual_seed(22)
    batches = [torch.randn(2, n, dim, generator=g) * scale for n, scale in [(8, 1.0), (5, 0.7), (12, 1.3), (6, 0.5)]]
    steps = [0, 3, torch.tensor(7), 15]  # decays 0.5, 0.62, 0.78, 0.9 (clamped); one step given as a tensor
    for x, s in zip(batches, steps):
        q(x, step=s)
    E, N, M, U = numpy_rvq_ema(codebooks, [b.numpy() for b in batches], steps, eps=1e-5, **{
        k: cfg[k] for k in ("decay_start", "decay_end", "decay_steps", "dead_code_steps")})
    for l, cb in enumerate(q.levels):
        np.testing.assert_allclose(cb.embed.double().numpy(), E[l], rtol=1e-5, atol=1e-6, err_msg=f"embed {l}")
        np.testing.assert_allclose(cb.ema_count.double().numpy(), N[l], rtol=1e-5, atol=1e-6, err_msg=f"count {l}")
        np.testing.assert_allclose(cb.ema_sum.double().numpy(), M[l], rtol=1e-5, atol=1e-6, err_msg=f"sum {l}")
        np.testing.assert_array_equal(cb.unused_steps.numpy(), U[l], err_msg=f"unused {l}")
        assert not np.allclose(E[l], codebooks[l])  # the reference did move the codebook
    # the data exercised both branches: codes assigned in the last step and codes left unused
    assert all((u == 0).any() for u in U) and any((u > 0).any() for u in U)


# --------------------------------------------------------------------------------------------------
# 4. commitment loss, straight-through gradient, gradient at every level
# --------------------------------------------------------------------------------------------------
def analytic_levels(q, z, indices):
    """float64 residuals: per-level commit loss and its gradient 2 (r_l - q_l) / numel w.r.t. z."""
    r = z.detach().reshape(-1, q.dim).double()
    idx = indices.reshape(-1, q.num_levels)
    losses, grads = [], []
    for l in range(q.num_levels):
        qv = q.codebook(l).double()[idx[:, l]]
        losses.append(((r - qv) ** 2).mean())
        grads.append((2 * (r - qv) / r.numel()).reshape(z.shape))
        r = r - qv
    return torch.stack(losses), grads


def prefix_quantizer(q: ResidualVectorQuantizer, n_levels: int) -> ResidualVectorQuantizer:
    p = ResidualVectorQuantizer(q.dim, q.codebook_sizes[:n_levels], init_from_data=False)
    sd = {k: v for k, v in q.state_dict().items() if not k.startswith("levels.") or int(k.split(".")[1]) < n_levels}
    p.load_state_dict(sd)
    return p.eval()


def test_commit_loss_and_gradients():
    dim, sizes = 5, (4, 8, 16)
    q = rvq(dim, sizes, seed=3).eval()
    z = torch.randn(3, 7, dim, generator=torch.Generator().manual_seed(33)).requires_grad_()
    out = q(z)
    losses, grads = analytic_levels(q, z, out.indices)
    torch.testing.assert_close(out.level_commit_losses.double(), losses, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(out.commit_loss.double(), losses.sum(), rtol=1e-5, atol=1e-7)
    # nothing updated (eval): the monitored codebook loss equals the commitment loss
    torch.testing.assert_close(out.codebook_loss, out.commit_loss.detach(), rtol=1e-6, atol=1e-7)

    # straight-through: d(sum(quantized * g))/dz == g exactly
    gout = torch.randn(z.shape, generator=torch.Generator().manual_seed(34))
    (gz,) = torch.autograd.grad((out.quantized * gout).sum(), z, retain_graph=True)
    assert torch.equal(gz, gout)

    # total commitment gradient = sum of the per-level analytic gradients
    (gc,) = torch.autograd.grad(out.commit_loss, z)
    torch.testing.assert_close(gc.double(), sum(grads), rtol=1e-5, atol=1e-8)

    # each level alone: level l's term is commit(first l+1 levels) - commit(first l levels) (same codebooks)
    previous = torch.zeros_like(z, dtype=torch.float64)
    for l in range(len(sizes)):
        zl = z.detach().clone().requires_grad_()
        out_l = prefix_quantizer(q, l + 1)(zl)
        assert torch.equal(out_l.indices, out.indices[..., : l + 1])
        (g_prefix,) = torch.autograd.grad(out_l.commit_loss, zl)
        level_grad = g_prefix.double() - previous
        previous = g_prefix.double()
        assert float(level_grad.abs().sum()) > 1e-3, f"no gradient from level {l}"
        torch.testing.assert_close(level_grad, grads[l], rtol=1e-4, atol=1e-7)


def test_commit_gradient_in_training_step_uses_codes_before_update():
    dim, sizes = 4, (4, 8)
    q = rvq(dim, sizes, seed=4).train()
    before = copy.deepcopy(q).eval()
    z = torch.randn(16, dim, generator=torch.Generator().manual_seed(44)).requires_grad_()
    out = q(z, step=0)  # EMA update happens inside the forward
    assert not torch.equal(q.codebook(0), before.codebook(0))
    losses, grads = analytic_levels(before, z, out.indices)
    torch.testing.assert_close(out.commit_loss.double(), losses.sum(), rtol=1e-5, atol=1e-7)
    (gc,) = torch.autograd.grad(out.commit_loss, z)
    torch.testing.assert_close(gc.double(), sum(grads), rtol=1e-5, atol=1e-8)


# --------------------------------------------------------------------------------------------------
# 5. dead-code revival
# --------------------------------------------------------------------------------------------------
def _revival_setup():
    """Level 0: A=+10e1, B=-10e1 and four far codes; level 1: P=+e2, Q=-e2 and two unused codes."""
    e1, e2, e3, e4 = torch.eye(4)
    q = rvq(4, (6, 4), dead_code_steps=2, decay_start=0.8, decay_end=0.9, decay_steps=4).train()
    set_codes(q, 0, torch.stack([10 * e1, -10 * e1, 10 * e3, -10 * e3, 10 * e4, -10 * e4]))
    set_codes(q, 1, torch.stack([e2, -e2, e3, -e3]))
    g = torch.Generator().manual_seed(55)
    near_a = lambda n: 10 * e1 + e2 + 0.05 * torch.randn(n, 4, generator=g)  # noqa: E731  (codes A, P)
    near_b = lambda n: -10 * e1 - e2 + 0.05 * torch.randn(n, 4, generator=g)  # noqa: E731  (codes B, Q)
    return q, near_a, near_b


def test_revive_dead_codes_and_they_survive_the_next_update():
    q, near_a, near_b = _revival_setup()
    q(torch.cat([near_a(8), near_b(8)]), step=0)  # uses A, B / P, Q
    pre = copy.deepcopy(q)
    x2 = near_a(16)
    out2 = q(x2, step=1)  # uses A / P only: the far codes reach 2 unused updates, B and Q only 1
    # the residuals of the last batch, from the codes before that update
    res = [x2, x2 - pre.codebook(0)[out2.indices[:, 0]]]
    dead = [m.clone() for m in q.dead_codes()]
    assert [m.tolist() for m in dead] == [[False, False, True, True, True, True], [False, False, True, True]]
    old = snapshot(q)
    control = copy.deepcopy(q)

    torch.manual_seed(5)
    counts = q.revive()
    assert counts == [int(m.sum()) for m in dead] == [4, 2]
    revived = []
    for l, cb in enumerate(q.levels):
        m = dead[l]
        assert bool(is_row_of(cb.embed[m], res[l]).all()), f"level {l}: revived codes are not residual rows"
        assert torch.equal(cb.ema_count[m], torch.ones(int(m.sum())))
        assert torch.equal(cb.ema_sum[m], cb.embed[m])
        assert torch.equal(cb.unused_steps[m], torch.zeros(int(m.sum()), dtype=torch.long))
        for name in FLOAT_BUFFERS + ("unused_steps",):  # live codes untouched
            assert torch.equal(getattr(cb, name)[~m], old[f"levels.{l}.{name}"][~m])
        revived.append(cb.embed[m].clone())

    # next batch: sits on the live codes B (level 0) and Q (level 1), far from every revived code
    x3 = q.codebook(0)[1] + q.codebook(1)[1] + 0.05 * torch.randn(16, 4, generator=torch.Generator().manual_seed(56))
    out3 = q(x3, step=2)
    for l, cb in enumerate(q.levels):
        dead_ids = set(torch.nonzero(dead[l]).flatten().tolist())
        assert not dead_ids & set(out3.indices[:, l].tolist()), "precondition: revived codes not assigned"
        rel = (cb.embed[dead[l]] - revived[l]).norm(dim=-1) / revived[l].norm(dim=-1)
        assert float(rel.max()) < 1e-3, f"level {l}: revived codes moved by {rel.tolist()}"

    # negative control: overwrite embed only (stale M/N): the next update pulls the codes back to M/N
    for l, cb in enumerate(control.levels):
        cb.embed[dead[l]] = revived[l]
    out_c = control(x3, step=2)
    assert torch.equal(out_c.indices, out3.indices)
    for l, cb in enumerate(control.levels):
        moved = (cb.embed[dead[l]] - revived[l]).norm(dim=-1)
        assert float(moved.min()) > 1.0
        torch.testing.assert_close(cb.embed[dead[l]], old[f"levels.{l}.embed"][dead[l]], rtol=1e-3, atol=1e-3)


def test_revive_before_any_update_does_nothing():
    q = rvq(4, (4, 8), dead_code_steps=1)
    before = snapshot(q)
    assert q.revive() == [0, 0]
    assert_states_equal(before, snapshot(q))


# --------------------------------------------------------------------------------------------------
# 6. fp32 everywhere
# --------------------------------------------------------------------------------------------------
def test_fp32_under_autocast_and_after_module_casts():
    q = rvq(4, (4, 8), seed=6).train()
    e1, e2 = torch.eye(4)[:2]
    set_codes(q, 0, torch.stack([0 * e1, 1.003 * e1, 3 * e2, -3 * e2]))
    reference = copy.deepcopy(q)
    z = torch.randn(2, 6, 4, generator=torch.Generator().manual_seed(66))
    # a near tie that bf16 gets wrong: in fp32 0.5018 e1 is nearer 1.003 e1 than 0 (by 6e-4 in squared distance);
    # rounded to bf16 (0.5018 -> 0.5, 1.003 -> 1.0) the distance to 1.003 e1 comes out larger by 6e-3
    z[:, 0] = 0.5018 * e1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = q(z, step=0)
    out_ref = reference(z, step=0)  # no autocast at all: the same fp32 math, so bit-identical results
    assert out.indices[:, 0, 0].tolist() == [1, 1], "nearest code computed in reduced precision"
    for name, buf in q.named_buffers():
        if buf.is_floating_point():
            assert buf.dtype == torch.float32, name
    assert out.commit_loss.dtype == torch.float32 and out.codebook_loss.dtype == torch.float32
    assert out.quantized.dtype == torch.float32
    assert torch.equal(out.quantized, out_ref.quantized) and torch.equal(out.commit_loss, out_ref.commit_loss)
    assert_states_equal(snapshot(q), snapshot(reference))

    before = snapshot(q)
    for cast in ("bfloat16", "half"):
        getattr(q, cast)()
        for l, cb in enumerate(q.levels):
            for name in FLOAT_BUFFERS:
                buf = getattr(cb, name)
                assert buf.dtype == torch.float32, (cast, l, name)
                assert torch.equal(buf, before[f"levels.{l}.{name}"]), (cast, l, name)
        assert_states_equal(before, snapshot(q))

    zb = z.bfloat16()
    out_b = q.eval()(zb)
    assert out_b.quantized.dtype == torch.bfloat16 and out_b.commit_loss.dtype == torch.float32
    assert torch.equal(out_b.indices, q(zb.float()).indices)  # bf16 -> fp32 is exact
    torch.testing.assert_close(out_b.quantized, q.decode_indices(out_b.indices).bfloat16())
    out_t = q.train()(zb, step=1)
    assert out_t.quantized.dtype == torch.bfloat16
    assert all(getattr(cb, n).dtype == torch.float32 for cb in q.levels for n in FLOAT_BUFFERS)


def test_codebooks_are_fp32_under_a_float64_default_dtype():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        q = rvq(4, (4, 8), seed=6).train()
        out = q(torch.randn(2, 3, 4), step=0)  # a float64 input: quantized in fp32, returned as float64
    finally:
        torch.set_default_dtype(previous)
    assert all(getattr(cb, n).dtype == torch.float32 for cb in q.levels for n in FLOAT_BUFFERS)
    assert out.quantized.dtype == torch.float64 and out.commit_loss.dtype == torch.float32


def test_an_unused_code_shrinks_by_the_formulas_factor():
    # e = M / (N + eps) with N, M both decayed by g per update and no assignment: g^t / (g^t + eps) of the code
    g, eps, steps = 0.9, 1e-5, 120
    q = rvq(2, (2,), decay_start=g, decay_end=g, decay_steps=0, eps=eps, dead_code_steps=1000).train()
    codes = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    set_codes(q, 0, codes)
    z = torch.tensor([[1.0, 0.0]])  # always nearest code 0; code 1 is never used
    for step in range(steps):
        q(z, step=step)
    expected = g**steps / (g**steps + eps)  # 0.150: shrunk towards zero, not kept in place
    torch.testing.assert_close(q.codebook(0)[1], codes[1] * expected, rtol=1e-4, atol=0)
    torch.testing.assert_close(q.codebook(0)[0], codes[0])  # the used code stays on its input


# --------------------------------------------------------------------------------------------------
# 7. decay schedule: a pure function of the global step
# --------------------------------------------------------------------------------------------------
def test_decay_schedule_is_a_pure_function_of_the_step():
    cfg = dict(decay_start=0.8, decay_end=0.96, decay_steps=100)
    fresh = rvq(4, (4, 8), **cfg)
    assert fresh.decay_at(0) == 0.8
    assert fresh.decay_at(100) == pytest.approx(0.96, abs=1e-12)
    assert fresh.decay_at(50) == pytest.approx(0.88, abs=1e-12)
    assert fresh.decay_at(25) == pytest.approx(0.84, abs=1e-12)
    assert fresh.decay_at(10_000) == pytest.approx(0.96, abs=1e-12)
    assert fresh.decay_at(-7) == 0.8
    for s in (0, 1, 25, 50, 99, 100, 150):
        t = fresh.decay_at(torch.tensor(s))
        assert isinstance(t, torch.Tensor) and float(t) == pytest.approx(fresh.decay_at(s), abs=1e-7)
    assert rvq(4, (4,), decay_steps=0, decay_end=0.97).decay_at(12) == 0.97

    trained = rvq(4, (4, 8), **cfg).train()
    g = torch.Generator().manual_seed(77)
    for s in range(5):
        trained(torch.randn(12, 4, generator=g), step=s * 10)
    for s in (0, 3, 37, 50, 100, 500):
        assert trained.decay_at(s) == fresh.decay_at(s)

    # the EMA step at s depends only on the state, not on the history that led to it
    loaded = rvq(4, (4, 8), seed=99, **cfg).train()
    loaded.load_state_dict(copy.deepcopy(trained.state_dict()))
    x = torch.randn(12, 4, generator=g)
    out_a, out_b = trained(x, step=37), loaded(x, step=37)
    assert_states_equal(snapshot(trained), snapshot(loaded))
    assert torch.equal(out_a.quantized, out_b.quantized) and torch.equal(out_a.codebook_loss, out_b.codebook_loss)


# --------------------------------------------------------------------------------------------------
# 8. state_dict round trip and data-dependent init
# --------------------------------------------------------------------------------------------------
def test_state_dict_round_trip_and_no_reinit():
    cfg = dict(dim=4, sizes=(4, 8), dead_code_steps=50, init_from_data=True)
    a = rvq(seed=8, **cfg).train()
    g = torch.Generator().manual_seed(88)
    for s in range(4):
        a(torch.randn(10, 4, generator=g) * (1 + s), step=s)
    assert bool(a.initialized) and any(int(cb.unused_steps.max()) > 0 for cb in a.levels)

    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    b = rvq(seed=123, **cfg)
    assert not bool(b.initialized)
    b.load_state_dict(sd)
    assert "initialized" in sd and "levels.1.unused_steps" in sd
    assert_states_equal(snapshot(a), snapshot(b))

    z = torch.randn(3, 5, 4, generator=g)
    oa, ob = a.eval()(z), b.eval()(z)
    assert torch.equal(oa.quantized, ob.quantized) and torch.equal(oa.indices, ob.indices)
    assert torch.equal(oa.commit_loss, ob.commit_loss)

    # the loaded, initialised module does not re-initialise on its next training step
    x = torch.randn(10, 4, generator=g)
    torch.manual_seed(1)
    a.train()(x, step=4)
    torch.manual_seed(1)
    b.train()(x, step=4)
    assert_states_equal(snapshot(a), snapshot(b))

    # and an initialised module that loads an uninitialised state does initialise again
    fresh_sd = snapshot(rvq(seed=9, **cfg))
    c, d = copy.deepcopy(a), rvq(seed=10, **cfg).train()
    c.load_state_dict(fresh_sd)
    d.load_state_dict(fresh_sd)
    torch.manual_seed(2)
    c(x, step=0)
    torch.manual_seed(2)
    d(x, step=0)
    assert bool(c.initialized)
    assert_states_equal(snapshot(c), snapshot(d))


def test_data_dependent_init():
    sizes = (6, 8)
    x = torch.randn(20, 4, generator=torch.Generator().manual_seed(90))

    q = rvq(4, sizes, seed=9, init_from_data=True)
    assert not bool(q.initialized)
    q.eval()(x, step=0)
    q.train()(x)  # no step: no init either
    assert not bool(q.initialized)

    torch.manual_seed(3)
    q._init_from(x)
    assert bool(q.initialized)
    c0 = q.codebook(0)
    assert bool(is_row_of(c0, x, atol=0).all())
    assert len({tuple(r.tolist()) for r in c0}) == sizes[0]  # distinct rows (20 >= 6: no repeats)
    r1 = x - c0[torch.cdist(x.double(), c0.double()).argmin(-1)]
    assert bool(is_row_of(q.codebook(1), r1).all())
    for cb in q.levels:
        assert torch.equal(cb.ema_count, torch.ones(cb.size)) and torch.equal(cb.ema_sum, cb.embed)

    # fewer rows than codes: each row becomes one code, the other codes keep their random init (no duplicates)
    small = rvq(4, sizes, seed=9, init_from_data=True)
    random_init = small.codebook(0).clone()
    small._init_from(x[:3])
    from_rows = is_row_of(small.codebook(0), x[:3], atol=0)
    assert int(from_rows.sum()) == 3 and bool(is_row_of(x[:3], small.codebook(0), atol=0).all())
    assert torch.equal(small.codebook(0)[~from_rows], random_init[~from_rows])

    # the first training forward = this init, then the EMA update with those codes
    fwd = rvq(4, sizes, seed=9, init_from_data=True).train()
    torch.manual_seed(3)
    fwd(x, step=0)
    assert bool(fwd.initialized)
    q.train()(x, step=0)  # already initialised: EMA update only
    assert_states_equal(snapshot(fwd), snapshot(q))


def _min_pairwise_distance(codes: torch.Tensor) -> float:
    d = torch.cdist(codes.double(), codes.double())
    return float(d[~torch.eye(len(codes), dtype=torch.bool)].min())


def test_codes_are_never_duplicates_with_more_codes_than_vectors():
    """A world quantizer sees one vector per clip: 32 vectors for levels of up to 256 codes. Neither the init
    (where a row picked as a code leaves a zero residual below it) nor revival (more dead codes than rows)
    may create equal codes: argmin always picks the first of equal codes and the EMA never separates them."""
    sizes = (12, 24, 48, 256, 256, 256)
    q = rvq(8, sizes, seed=0, init_from_data=True, dead_code_steps=1).train()
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(40, 8, generator=g)
    for step in range(30):
        x = centres[torch.randint(0, 40, (32,), generator=g)] + 0.1 * torch.randn(32, 8, generator=g)
        q(x, step=step)
        if step == 0:
            for level, cb in enumerate(q.levels):
                assert _min_pairwise_distance(cb.embed) > 0, f"init, level {level}"
        revived = q.revive(generator=torch.Generator().manual_seed(step))
        assert all(n <= 32 for n in revived)
        for level, cb in enumerate(q.levels):
            assert _min_pairwise_distance(cb.embed) > 0, f"step {step}, level {level}"
    # the big levels fill up with data over the revivals instead of all at once
    assert all(int((cb.unused_steps == 0).sum()) > 32 for cb in q.levels[3:])


# --------------------------------------------------------------------------------------------------
# 9. errors
# --------------------------------------------------------------------------------------------------
def test_errors():
    q = rvq(4, (4, 8))
    with pytest.raises(ValueError, match="indices"):
        q.decode_indices(torch.tensor([[0, 8]]))  # level 1 has codes 0..7
    with pytest.raises(ValueError, match="indices"):
        q.decode_indices(torch.tensor([[4, 0]]))
    with pytest.raises(ValueError, match="indices"):
        q.decode_indices(torch.tensor([[-1, 0]]))
    with pytest.raises(ValueError, match="indices"):
        q.decode_indices(torch.tensor([[0, 1, 2]]))
    with pytest.raises(ValueError, match="indices"):
        q.decode_indices(torch.tensor([[0.0, 1.0]]))
    with pytest.raises(ValueError, match="indices"):
        q.decode_indices(torch.tensor([[True, False]]))
    assert torch.equal(q.decode_indices(torch.tensor([[3, 7]])), (q.codebook(0)[3] + q.codebook(1)[7])[None])


# --------------------------------------------------------------------------------------------------
# 10. DDP (gloo, 2 processes)
# --------------------------------------------------------------------------------------------------
DDP_STEPS = (0, 2, 5)
DDP_FINAL_STEP = 7


def _ddp_setup():
    """Same quantizer and batches in every process: data only near level-0 codes 0..2, so codes die."""
    q = rvq(4, (8, 8), seed=10, decay_start=0.5, decay_end=0.9, decay_steps=6, dead_code_steps=2).train()
    g = torch.Generator().manual_seed(101)
    centers = q.codebook(0)[[0, 1, 2, 0]].clone()
    batches = [centers.repeat(4, 1) + 0.05 * torch.randn(16, 4, generator=g) for _ in range(len(DDP_STEPS) + 1)]
    return q, batches


def _join_gloo(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))


def _ddp_worker(rank: int, world: int, port: int, outdir: str) -> None:
    _join_gloo(rank, world, port)
    try:
        q, batches = _ddp_setup()
        half = batches[0].shape[0] // world
        for x, s in zip(batches, DDP_STEPS):
            q(x[rank * half : (rank + 1) * half], step=s)
        torch.save(snapshot(q), Path(outdir) / f"pre_{rank}.pt")
        torch.manual_seed(1000 + rank)  # different random picks per rank: the broadcast must align them
        revived = q.revive()
        q(batches[-1][rank * half : (rank + 1) * half], step=DDP_FINAL_STEP)
        torch.save({"state": snapshot(q), "revived": torch.tensor(revived)}, Path(outdir) / f"post_{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ddp_two_ranks_match_single_process(tmp_path):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_ddp_worker, args=(r, 2, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=90)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join(5)
    assert not hung, "DDP workers hung"
    assert [p.exitcode for p in procs] == [0, 0]

    pre = [torch.load(tmp_path / f"pre_{r}.pt", weights_only=True) for r in range(2)]
    post = [torch.load(tmp_path / f"post_{r}.pt", weights_only=True) for r in range(2)]

    # before revive: both ranks equal the single process fed the whole batch at the same steps
    single, batches = _ddp_setup()
    for x, s in zip(batches, DDP_STEPS):
        single(x, step=s)
    ref = snapshot(single)
    for r in range(2):
        assert pre[r].keys() == ref.keys()
        for k in ref:
            if ref[k].is_floating_point():
                torch.testing.assert_close(pre[r][k], ref[k], rtol=1e-5, atol=1e-6, msg=f"rank {r} {k}")
            else:
                assert torch.equal(pre[r][k], ref[k]), (r, k)
    assert_states_equal(pre[0], pre[1])

    # after revive (random picks, broadcast from rank 0) and one more step: identical codebooks
    assert torch.equal(post[0]["revived"], post[1]["revived"])
    assert int(post[0]["revived"].sum()) > 0
    assert post[0]["revived"].tolist() == [int(m.sum()) for m in single.dead_codes()]
    assert_states_equal(post[0]["state"], post[1]["state"])
    assert not torch.equal(post[0]["state"]["levels.0.embed"], pre[0]["levels.0.embed"])


def test_non_finite_batch_leaves_the_codebooks_unchanged():
    torch.manual_seed(0)
    q = ResidualVectorQuantizer(4, (3, 5), dead_code_steps=100).train()
    q(torch.randn(64, 4), step=0)  # initialise from a clean batch
    near_code_0 = q.codebook(0)[0] + 0.01 * torch.randn(16, 4)
    for step in (1, 2, 3):  # clean batches that leave some codes unused: their counters climb above 0
        q(near_code_0, step=step)
    before = {k: v.clone() for k, v in q.state_dict().items()}
    bad = torch.randn(64, 4)
    bad[7, 1] = float("nan")
    # the bad batch's finite rows fall on codes whose counters are above 0 (else a reset to 0 would not show)
    hit = q.eval()(bad).indices
    q.train()
    for level, cb in enumerate(q.levels):
        assert int(cb.unused_steps[hit[:, level]].max()) == 3, level
    q(bad, step=4)
    for key, value in q.state_dict().items():
        assert torch.equal(value, before[key]), key
    q(torch.randn(64, 4), step=5)  # and a clean batch updates again
    assert not torch.equal(q.state_dict()["levels.0.ema_count"], before["levels.0.ema_count"])


def test_non_finite_first_batch_does_not_initialise():
    q = ResidualVectorQuantizer(4, (3,)).train()
    q(torch.full((16, 4), float("inf")), step=0)
    assert not bool(q.initialized) and torch.isfinite(q.codebook(0)).all()
    q(torch.randn(16, 4), step=1)
    assert bool(q.initialized) and torch.isfinite(q.codebook(0)).all()


def test_revival_after_a_non_finite_batch_takes_only_its_finite_rows():
    """A NaN/inf batch leaves the codebooks alone but is still the last batch: revive() then draws only from its
    finite rows' residuals, so with more dead codes than rows it revives exactly as many codes as finite rows."""
    q = rvq(4, (6, 6), seed=3, dead_code_steps=1).train()
    g = torch.Generator().manual_seed(31)
    q(q.codebook(0)[0] + 0.01 * torch.randn(8, 4, generator=g), step=0)  # level 0: codes 1..5 die
    bad = torch.randn(4, 4, generator=g) * 3
    bad[1, 2] = float("nan")
    bad[3, 0] = float("inf")
    finite = bad[[0, 2]]
    dead = [m.clone() for m in q.dead_codes()]
    assert int(dead[0].sum()) == 5 and int(dead[1].sum()) >= 2  # more dead codes than finite rows per level
    old = snapshot(q)
    out = q(bad, step=1)
    assert_states_equal(old, snapshot(q))  # the batch changed nothing, the dead codes are still dead
    res = [finite, finite - q.codebook(0)[out.indices[[0, 2], 0]]]  # the finite rows' residual per level
    assert q.revive(generator=torch.Generator().manual_seed(0)) == [2, 2]
    for l, cb in enumerate(q.levels):
        for name in FLOAT_BUFFERS:
            assert torch.isfinite(getattr(cb, name)).all(), (l, name)
        changed = (cb.embed != old[f"levels.{l}.embed"]).any(-1)
        assert int(changed.sum()) == 2 and not (changed & ~dead[l]).any(), l  # two dead codes, no live one
        assert bool(is_row_of(cb.embed[changed], res[l], atol=0).all()), l
        assert bool(is_row_of(res[l], cb.embed[changed], atol=0).all()), l  # both finite rows, once each


def test_codebook_loss_is_measured_against_the_updated_codes():
    """The monitored codebook loss ``||sg[z_e] - e'||^2`` uses the codebooks after this step's EMA update (the
    residuals are still formed from the codes the step chose); against the old codes it would equal the
    commitment loss."""
    q = rvq(4, (4, 8), seed=4).train()
    before = copy.deepcopy(q).eval()
    z = torch.randn(16, 4, generator=torch.Generator().manual_seed(44))
    out = q(z, step=0)
    residual, expected = z.double(), 0.0
    for level in range(2):
        i = out.indices[:, level]
        expected = expected + ((residual - q.codebook(level).double()[i]) ** 2).mean()
        residual = residual - before.codebook(level).double()[i]
    torch.testing.assert_close(out.codebook_loss.double(), expected, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(out.codebook_loss, out.commit_loss)


def test_distinct_rows_excludes_only_rows_equal_in_every_coordinate():
    """Revival's exclusion drops a candidate row only when it equals a live code in every coordinate."""
    rows = torch.tensor([[1.0, 2.0], [1.0, 5.0], [3.0, 2.0], [4.0, 4.0]])
    exclude = torch.tensor([[1.0, 2.0]])  # [1, 5] and [3, 2] share one coordinate with it: they stay
    out = _distinct_rows(rows, 10, torch.Generator().manual_seed(0), exclude=exclude)
    assert sorted(map(tuple, out.tolist())) == [(1.0, 5.0), (3.0, 2.0), (4.0, 4.0)]


def _draw_setup():
    """Level 0 has 16 codes, a rank's half of the batch 8 rows: drawn from rank 0's rows alone, half the codes
    would keep their random init. The second batch sits near 2 codes, so the others die (after 1 update)."""
    q = rvq(4, (16, 8), seed=3, init_from_data=True, decay_start=0.5, decay_end=0.5, decay_steps=0, dead_code_steps=1)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(16, 4, generator=g)
    last = x[[0, 1]].repeat(8, 1) + 0.01 * torch.randn(16, 4, generator=g)
    return q.train(), x, last


def _ddp_draw_worker(rank: int, world: int, port: int, outdir: str) -> None:
    _join_gloo(rank, world, port)
    try:
        q, x, last = _draw_setup()
        half = x.shape[0] // world
        torch.manual_seed(7 + rank)  # each rank its own draws: rank 0's are kept
        q(x[rank * half : (rank + 1) * half], step=0)
        init = snapshot(q)
        q(last[rank * half : (rank + 1) * half], step=1)
        torch.manual_seed(8 + rank)
        revived = q.revive()
        torch.save({"init": init, "post": snapshot(q), "revived": torch.tensor(revived)}, Path(outdir) / f"draw_{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ddp_init_and_revival_draw_from_every_ranks_rows_as_one_process_from_the_whole_batch(tmp_path):
    """Data init and revival under 2 ranks equal one process fed the concatenated batch with rank 0's random
    draws: the candidates are every rank's rows, not rank 0's alone (which filled 8 of 16 codes from data)."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    mp.start_processes(_ddp_draw_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    ranks = [torch.load(tmp_path / f"draw_{r}.pt", weights_only=True) for r in range(2)]
    single, x, last = _draw_setup()
    torch.manual_seed(7)
    single(x, step=0)
    init = snapshot(single)
    # all 16 level-0 codes drawn from the batch's 16 rows: each is its row's nearest code, so none went unused
    assert int(init["levels.0.unused_steps"].max()) == 0
    single(last, step=1)
    torch.manual_seed(8)
    revived = single.revive()
    assert sum(revived) > 0 and ranks[0]["revived"].tolist() == ranks[1]["revived"].tolist() == revived
    for r in range(2):
        for key in init:
            torch.testing.assert_close(ranks[r]["init"][key], init[key], rtol=1e-5, atol=1e-6, msg=f"init {r} {key}")
            torch.testing.assert_close(ranks[r]["post"][key], snapshot(single)[key], rtol=1e-5, atol=1e-6,
                                       msg=f"after revival {r} {key}")


def _ddp_nan_init_worker(rank: int, world: int, port: int, outdir: str) -> None:
    _join_gloo(rank, world, port)
    try:
        q, x, _ = _draw_setup()
        half = x.shape[0] // world
        mine = x[rank * half : (rank + 1) * half].clone()
        if rank == 0:
            mine[1, 2] = float("nan")  # rank 0's first batch holds a NaN; rank 1's is finite
        q(mine, step=0)
        torch.save({"initialized": q.initialized.clone(), "codes": q.codebook(0).clone()}, Path(outdir) / f"nan_{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_one_ranks_non_finite_first_batch_initialises_no_rank(tmp_path):
    """A NaN in one rank's first batch leaves every rank's codebooks uninitialised (as one process fed the whole
    batch would): the ranks agree on it (a MIN all-reduce of their verdicts), and their codebooks stay identical."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    mp.start_processes(_ddp_nan_init_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    ranks = [torch.load(tmp_path / f"nan_{r}.pt", weights_only=True) for r in range(2)]
    assert not bool(ranks[0]["initialized"]) and not bool(ranks[1]["initialized"])
    assert torch.equal(ranks[0]["codes"], ranks[1]["codes"])
