"""torch.compile must compute the same training step as eager, with the quantizers' in-place EMA updates."""

import copy

import pytest
import torch

from lwm.modules.rvq import ResidualVectorQuantizer


def _steps(q: ResidualVectorQuantizer, lin: torch.nn.Linear, fn, data):
    torch.manual_seed(1)  # the data-dependent codebook init draws random rows
    losses = []
    for step, x in enumerate(data):
        loss = fn(x, step)
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses), lin.weight.grad.clone()


@pytest.mark.timeout(300)
def test_inductor_compiled_step_equals_eager_with_ema_updates():
    torch.manual_seed(0)
    q = ResidualVectorQuantizer(8, (4, 6), decay_steps=3)
    lin = torch.nn.Linear(8, 8)
    q2, lin2 = copy.deepcopy(q), copy.deepcopy(lin)
    data = [torch.randn(16, 8) for _ in range(4)]

    def make(qz, ln):
        def f(x, step):
            out = qz(ln(x), step=step)
            return out.quantized.pow(2).mean() + out.commit_loss
        return f

    eager_losses, eager_grad = _steps(q, lin, make(q, lin), data)
    compiled_losses, compiled_grad = _steps(q2, lin2, torch.compile(make(q2, lin2), backend="inductor"), data)
    assert torch.allclose(eager_losses, compiled_losses, atol=1e-5)
    assert torch.allclose(eager_grad, compiled_grad, atol=1e-5)
    for a, b in zip(q.buffers(), q2.buffers()):
        assert torch.allclose(a.float(), b.float(), atol=1e-5)
