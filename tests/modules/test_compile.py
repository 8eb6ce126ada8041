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


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_compile_parts_keeps_state_dict_keys_and_the_loss():
    """Compiled (through AOTAutograd) equals eager, without ``_orig_mod.`` keys."""
    from lwm.modules.world_model import WorldModel

    torch.manual_seed(0)
    eager = WorldModel(in_channels=2, height=8, width=8, d_model=16, n_heads=2, depth_action=1, depth_world=1,
                       depth_dynamics=1, d_code_action=4, d_code_world=4, codebook_sizes_action=(3,),
                       codebook_sizes_world=(3,), mask_prob=0.0)
    compiled = copy.deepcopy(eager)
    compiled.compile_parts(backend="aot_eager")  # traces forward and backward through AOTAutograd
    assert list(compiled.state_dict()) == list(eager.state_dict())  # no `_orig_mod.` keys
    x = torch.rand(2, 5, 2, 8, 8) * 2 - 1
    losses = []
    for model in (eager, compiled):
        torch.manual_seed(1)  # the codebook init from data draws random rows
        loss = model.compute(x, step=0, t0=0).loss
        loss.backward()
        losses.append((loss.detach(), model.tokenizer.net[0].weight.grad.clone()))
    assert torch.allclose(losses[0][0], losses[1][0], atol=1e-6)
    assert torch.allclose(losses[0][1], losses[1][1], atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_compiled_parts_have_no_graph_breaks_in_the_training_step(checkpointing):
    """Dynamo traces every compiled part, with the exact arguments the training step gives it (every rollout pass
    of the predictor, with and without activation checkpointing), as one graph."""
    from lwm.modules.world_model import WorldModel

    torch.manual_seed(0)
    model = WorldModel(in_channels=2, height=8, width=8, d_model=16, n_heads=2, depth_action=2, depth_world=1,
                       depth_dynamics=2, d_code_action=4, d_code_world=4, codebook_sizes_action=(3,),
                       codebook_sizes_world=(3,), rollout_weights=(1.0, 0.8, 0.5),
                       activation_checkpointing=checkpointing).train()
    calls = []
    hooks = [part.register_forward_pre_hook(lambda m, args, kwargs, name=name: calls.append((name, m, args, kwargs)),
                                            with_kwargs=True) for name, part in model.compiled_parts.items()]
    model.compute(torch.rand(2, 5, 2, 8, 8) * 2 - 1, step=0).loss.backward()
    for h in hooks:
        h.remove()
    assert {name for name, *_ in calls} == set(model.compiled_parts)
    assert sum(name == "dynamics" for name, *_ in calls) == 3  # teacher forcing and two rollout passes
    for name, part, args, kwargs in calls:
        explained = torch._dynamo.explain(part.forward)(*args, **kwargs)
        assert explained.graph_break_count == 0, (name, [r.reason for r in explained.break_reasons])
        assert explained.graph_count == 1, name


@pytest.mark.parametrize("part", ["Tokenizer", "Detokenizer"])
def test_inductor_lays_the_base_cnn_out_channels_last_on_a_gpu(part):
    """The CNN tokenizer's layout is left to inductor: its layout optimisation (on by default) converts a compiled
    graph's convolutions to channels-last where its heuristic expects a gain. Its GPU heuristic (the CPU's oneDNN
    path switched off) says yes for the base tokenizer's and detokenizer's training graphs."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from lwm.modules import st_transformer

    graph_lowering = pytest.importorskip("torch._inductor.graph").GraphLowering
    if not hasattr(graph_lowering, "decide_layout_opt"):
        pytest.skip("this torch's inductor decides layouts elsewhere")
    module = getattr(st_transformer, part)(16, 512)  # base: D = 512, hidden 256
    x = torch.randn(2, 16, 16, 16) if part == "Tokenizer" else torch.randn(2, 512, 4, 4)
    gm = make_fx(module)(x)
    assert sum(n.target is torch.ops.aten.convolution.default for n in gm.graph.nodes) == 3
    with torch.backends.mkldnn.flags(enabled=False):
        assert torch._inductor.config.layout_optimization
        assert graph_lowering.decide_layout_opt(gm, is_inference=False)
