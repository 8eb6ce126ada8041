import math
import warnings

import pytest
import torch

from lwm.utils.errors import ConfigError
from lwm.modules.world_model import WorldModel, WorldModelConfig

TINY = dict(
    in_channels=4, height=8, width=8, d_model=32, n_heads=2, tokenizer_hidden=16,
    d_code_action=8, d_code_world=8, codebook_sizes_action=(4, 8), codebook_sizes_world=(4, 4, 4),
)  # the default depth (3 blocks per transformer) is kept: causality must hold at that depth


def tiny_model(seed: int = 0, **overrides) -> WorldModel:
    torch.manual_seed(seed)
    return WorldModel(**{**TINY, **overrides})


def clip(B=2, T=6, C=4, H=8, W=8, seed=1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(B, T, C, H, W, generator=g) * 2 - 1


# --------------------------------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mask_prob", [0.0, 0.5])
def test_every_trainable_parameter_gets_a_gradient(mask_prob):
    """DDP (find_unused_parameters=False, configs/ddp.yaml) fails on a trainable parameter without a gradient:
    with mask_prob 0 the mask token is never used, so it is frozen."""
    model = tiny_model(mask_prob=mask_prob).train()
    model.compute(clip(), step=0, generator=torch.Generator().manual_seed(0)).loss.backward()
    missing = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert missing == []
    assert model.mask_token.requires_grad == (mask_prob > 0)


@pytest.mark.slow
def test_shapes_at_requirement_defaults():
    torch.manual_seed(0)
    model = WorldModel().eval()  # C=16, 64x64, D=512, 3 blocks each, codebooks (12,64,256) / (12,24,48,256,256,256)
    x = torch.rand(1, 4, 16, 64, 64) * 2 - 1
    with torch.no_grad():
        tokens = model.tokenize(x)
        assert tokens.shape == (1, 4, 256, 512)
        assert model.detokenize(tokens).shape == x.shape
        a = model.encode_actions(x)
        assert a.quantized.shape == (1, 3, 32) and a.indices.shape == (1, 3, 3)
        h = model.encode_world(x)
        assert h.quantized.shape == (1, 64) and h.indices.shape == (1, 6)
        pred = model.predict(x[:, :3], a.quantized, h.quantized)
        assert pred.shape == (1, 3, 16, 64, 64)
        loss, logs = model(x, step=0)
    assert loss.ndim == 0 and torch.isfinite(loss)


def test_the_requirements_defaults():
    """REQUIREMENT.md's defaults, read off the built model: 3 ST blocks per transformer, codebook sizes
    (12, 64, 256) and (12, 24, 48, 256, 256, 256), 10% token masking, 2 rollout passes weighted (1, 0.8, 0.5)."""
    from lwm.callbacks.sensitivity import Sensitivity
    from lwm.cli.overfit import parse

    model = WorldModel()
    for part in (model.action_encoder, model.world_encoder, model.dynamics):
        assert len(part.transformer.blocks) == 3
    assert [lvl.embed.shape[0] for lvl in model.action_encoder.rvq.levels] == [12, 64, 256]
    assert [lvl.embed.shape[0] for lvl in model.world_encoder.rvq.levels] == [12, 24, 48, 256, 256, 256]
    assert model.config.mask_prob == 0.1
    assert model.config.rollout_weights == (1.0, 0.8, 0.5)
    assert Sensitivity().t == 4  # "Genie uses t = 4"
    assert parse([])[0].steps == 1000  # the overfit test's --steps


def test_shapes_tiny_and_logs():
    model = tiny_model()
    x = clip(B=3, T=5)
    out = model.compute(x, step=0)
    assert out.actions.quantized.shape == (3, 4, 8) and out.actions.indices.shape == (3, 4, 2)
    assert out.world.quantized.shape == (3, 8) and out.world.indices.shape == (3, 3)
    assert len(out.predictions) == 3 and all(p.shape == (3, 4, 4, 8, 8) for p in out.predictions)
    assert out.token_mask.shape == (3, 5, 4)
    assert set(out.logs) == {
        "Total/loss", "Dynamics_Predictor/prediction_loss", "Dynamics_Predictor/tf_loss",
        "Dynamics_Predictor/rollout_1_loss", "Dynamics_Predictor/rollout_2_loss",
        "Action_Encoder/commit_loss", "Action_Encoder/codebook_loss",
        "World_Encoder/commit_loss", "World_Encoder/codebook_loss",
    }
    assert all(not v.requires_grad and v.ndim == 0 for v in out.logs.values())
    assert out.loss.requires_grad


# --------------------------------------------------------------------------------------------------
# Causality by perturbation (default depth 3)
# --------------------------------------------------------------------------------------------------
def _changed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per time position: did anything change? a, b: [B, t, ...] -> [t] bool. Causality tests run in float64,
    so a real dependence (however weak at init) stands far above rounding."""
    return (a - b).abs().flatten(2).amax(dim=(0, 2)) > 1e-10


@torch.no_grad()
@pytest.mark.parametrize("residual", [False, True])
def test_predictor_output_i_ignores_frames_and_actions_after_i(residual):
    model = tiny_model(residual=residual).eval().double()
    if residual:  # its last layer starts at zero: given weights, so that the prediction depends on what it reads
        torch.nn.init.normal_(model.get_submodule("detokenizer.net.6").weight, std=0.1)
    T = 6
    x = clip(T=T).double()
    a = torch.randn(2, T, 8, dtype=torch.float64)
    h = torch.randn(2, 8, dtype=torch.float64)
    base = model.predict(x, a, h)
    for j in range(T):
        x2 = x.clone()
        x2[:, j] += 0.5
        assert _changed(model.predict(x2, a, h), base).tolist() == [i >= j for i in range(T)], f"frame {j}"
        a2 = a.clone()
        a2[:, j] += 1.0
        assert _changed(model.predict(x, a2, h), base).tolist() == [i >= j for i in range(T)], f"action {j}"


@torch.no_grad()
@pytest.mark.parametrize("action_input", ["tokens", "transition"])
def test_action_i_depends_on_frames_up_to_i_plus_1_only(action_input):
    model = tiny_model(action_input=action_input).eval().double()
    T = 7
    x = clip(T=T).double()

    def actions(frames):
        return model.action_encoder.embed(model.action_tokens(frames))  # [B, T-1, Da], before quantization

    base = actions(x)
    for j in range(T):
        x2 = x.clone()
        x2[:, j] += 0.5
        # a_i summarises i -> i+1: it sees frame j iff j <= i + 1 (read alone, the transition's two frames only)
        expected = [j <= i + 1 and (action_input != "transition" or j >= i) for i in range(T - 1)]
        assert _changed(actions(x2), base).tolist() == expected, f"frame {j}"


@torch.no_grad()
def test_world_code_depends_on_every_frame():
    model = tiny_model().eval().double()
    x = clip(T=6).double()
    base = model.world_encoder.embed(model.tokenize(x) + model.pos_embedding(6))
    for j in range(6):
        x2 = x.clone()
        x2[:, j] += 0.5
        moved = model.world_encoder.embed(model.tokenize(x2) + model.pos_embedding(6))
        assert (moved - base).abs().amax() > 1e-10, f"frame {j}"


# --------------------------------------------------------------------------------------------------
# Rollout
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("train", [False, True])
def test_rollout_pass_k_repeats_previous_pass_on_its_first_k_positions(train):
    """The requirement's proof, on the reference that recomputes every position of every pass."""
    model = tiny_model(mask_prob=0.5, rollout_weights=(1.0, 0.8, 0.5, 0.3))
    model.train(train)
    out = model.compute(clip(T=7), step=0 if train else None, t0=3, reuse_prefix=False)
    if train:
        assert out.token_mask is not None and out.token_mask.any()
    for k in range(1, len(out.predictions)):
        prev, cur = out.predictions[k - 1], out.predictions[k]
        assert torch.allclose(cur[:, :k], prev[:, :k], atol=1e-5), f"pass {k}"
        assert not torch.allclose(cur[:, k], prev[:, k], atol=1e-4), f"pass {k} predicts something new at {k}"


@pytest.mark.slow
@pytest.mark.parametrize(("checkpointing", "kernel"), [(False, "sdpa"), (True, "sdpa"), (False, "matmul")])
def test_rollout_reusing_the_previous_pass_equals_recomputing_it(checkpointing, kernel):
    """Each rollout pass computes only the positions after the ones the previous pass already has (attending to
    its keys/values there): the same predictions, losses and gradients as recomputing every position, with
    token masks and a random PE start per sample, and fewer FLOPs."""
    from lwm.modules.flops import count_flops

    x = clip(T=7)
    results = []
    for reuse in (False, True):
        model = tiny_model(mask_prob=0.3, rollout_weights=(1.0, 0.8, 0.5, 0.3),
                           activation_checkpointing=checkpointing, temporal_attention=kernel).train()
        out = model.compute(x, step=None, generator=torch.Generator().manual_seed(4), reuse_prefix=reuse)
        assert out.token_mask.any()
        out.loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

        def step(model=model, reuse=reuse):
            model.compute(x, step=None, generator=torch.Generator().manual_seed(4), reuse_prefix=reuse).loss.backward()

        results.append((out, grads, count_flops(step).useful))
    (ref, ref_grads, ref_flops), (fast, fast_grads, fast_flops) = results
    assert torch.allclose(fast.loss, ref.loss, rtol=1e-5)
    for key in ref.logs:
        assert torch.allclose(fast.logs[key], ref.logs[key], rtol=1e-5, atol=1e-7), key
    for k, (a, b) in enumerate(zip(fast.predictions, ref.predictions)):
        assert torch.allclose(a, b, atol=1e-5), f"pass {k}"
    assert ref_grads.keys() == fast_grads.keys()
    for name in ref_grads:
        assert torch.allclose(fast_grads[name], ref_grads[name], rtol=1e-4, atol=1e-6), name
    assert fast_flops < ref_flops


@torch.no_grad()
def test_rollout_feeds_first_frame_and_previous_predictions():
    model = tiny_model().eval()
    x = clip(T=6)
    out = model.compute(x, step=None)
    a, h = out.actions.quantized, out.world.quantized
    assert torch.allclose(out.predictions[0], model.predict(x[:, :-1], a, h), atol=1e-5)
    for k in (1, 2):
        fed = torch.cat([x[:, :1], out.predictions[k - 1][:, :-1]], dim=1)
        assert torch.allclose(out.predictions[k], model.predict(fed, a, h), atol=1e-5)


@torch.no_grad()
def test_loss_is_the_requirements_weighted_sum():
    model = tiny_model(beta_action=0.3, beta_world=0.7).eval()
    x = clip(T=6)
    out = model.compute(x, step=None)
    target = x[:, 1:]
    tf = (out.predictions[0] - target).pow(2).mean()
    r1 = (out.predictions[1][:, 1:] - target[:, 1:]).pow(2).mean()
    r2 = (out.predictions[2][:, 2:] - target[:, 2:]).pow(2).mean()
    logs = out.logs
    assert torch.allclose(logs["Dynamics_Predictor/tf_loss"], tf)
    assert torch.allclose(logs["Dynamics_Predictor/rollout_1_loss"], r1)
    assert torch.allclose(logs["Dynamics_Predictor/rollout_2_loss"], r2)
    # the requirement's sums: each pass's over the frames it scores (C*H*W values each), divided by its number of
    # scored values (the masked means above); the commitments' over action vectors (Da) and the world vector (Dh),
    # divided by the teacher-forcing pass's (T-1)*C*H*W predicted values
    c = model.config
    elements = c.in_channels * c.height * c.width
    predicted = target[0].numel()  # (T-1) * C * H * W
    assert predicted == 5 * elements
    expected = (tf + 0.8 * r1 + 0.5 * r2 + 0.3 * out.actions.commit_loss * (5 * c.d_code_action) / predicted
                + 0.7 * out.world.commit_loss * c.d_code_world / predicted)
    assert torch.allclose(out.loss, expected)
    assert model.commitment_weights(6) == pytest.approx((0.3 * c.d_code_action / elements, 0.7 * c.d_code_world / predicted))
    # without an EMA update the monitored codebook loss is the commitment loss's value
    assert torch.allclose(logs["Action_Encoder/codebook_loss"], logs["Action_Encoder/commit_loss"])


# --------------------------------------------------------------------------------------------------
# Masking and positional start
# --------------------------------------------------------------------------------------------------
def test_token_masking_reaches_world_encoder_and_predictor_but_not_actions():
    model = tiny_model(mask_prob=0.3)
    x = clip(B=4, T=6)
    torch.manual_seed(5)
    train = model.train().compute(x, step=0, t0=0)
    with torch.no_grad():
        ev = model.eval().compute(x, step=None, t0=0)
    mask = train.token_mask
    assert mask is not None and ev.token_mask is None
    assert abs(mask.float().mean().item() - 0.3) < 0.08
    assert torch.allclose(train.actions.inputs, ev.actions.inputs, atol=1e-6)  # action encoder unmasked
    assert not torch.allclose(train.world.inputs, ev.world.inputs, atol=1e-4)
    # the predictor's inputs, every pass: the mask token (+ PE) exactly where the mask says, its own tokens elsewhere
    fed = []
    hook = model.dynamics.register_forward_pre_hook(lambda module, args: fed.append(args[0].detach()))
    with torch.no_grad():
        mask = model.train().compute(x, step=None, t0=0).token_mask
    hook.remove()
    assert len(fed) == len(model.config.rollout_weights)
    pe = model.pos_embedding(6, 0)  # [T, N, D]
    masked_input = (model.mask_token + pe).detach()
    with torch.no_grad():
        unmasked = model.tokenize(x) + pe  # pass 0's tokens (the ground truth's)
    for k, inputs in enumerate(fed):  # pass k computes positions k..T-2 (the earlier ones are reused)
        positions = mask[:, k:5]  # [B, 5 - k, N]
        assert inputs.shape[1] == 5 - k and positions.any()
        assert torch.allclose(inputs[positions], masked_input[k:5].expand(4, -1, -1, -1)[positions], atol=1e-6)
        if k == 0:
            assert torch.allclose(inputs[~positions], unmasked[:, :5][~positions], atol=1e-5)
    tokens = torch.randn(4, 6, 4, 32)
    masked = model.apply_token_mask(tokens, mask)
    assert torch.equal(masked[mask], model.mask_token.detach().expand(int(mask.sum()), 32))
    assert torch.equal(masked[~mask], tokens[~mask])


def test_time_offset_sampling_and_eval_default():
    model = tiny_model(max_time_offset=9)
    t0 = model.sample_time_offset(4000, torch.device("cpu"))
    assert t0.min() == 0 and t0.max() == 9
    model.eval()
    x = clip(T=5)
    with torch.no_grad():
        assert torch.equal(model(x, step=None, t0=None)[0], model(x, step=None, t0=0)[0])
        assert not torch.equal(model(x, step=None, t0=4)[0], model(x, step=None, t0=0)[0])


# --------------------------------------------------------------------------------------------------
# Training and precision
# --------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_loss_falls_on_one_fixed_clip():
    model = tiny_model(mask_prob=0.0).train()
    t = torch.linspace(0, 1, 6)[:, None, None, None]
    grid = torch.linspace(-1, 1, 8)
    x = (torch.sin(3 * grid[None, None, :, None] + 4 * t) * torch.cos(2 * grid[None, None, None, :] - 3 * t))
    x = x.expand(6, 4, 8, 8)[None].repeat(2, 1, 1, 1, 1).contiguous()  # [2, 6, 4, 8, 8], smooth motion
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(40):
        loss, logs = model(x, step=step, t0=0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(logs["Dynamics_Predictor/tf_loss"].item())
    assert sum(losses[-5:]) / 5 < 0.3 * sum(losses[:5]) / 5, losses


def test_bf16_autocast_keeps_quantizers_fp32():
    model = tiny_model()
    x = clip(T=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.compute(x, step=0, t0=0)
        z_raw = model.tokenize(x) + model.pos_embedding(5, 0)
        h, _, _ = model.action_encoder.transformer(z_raw)  # what the action encoder pools
    out.loss.backward()
    for rvq in model.quantizers.values():
        for name, buf in rvq.named_buffers():
            if buf.is_floating_point():
                assert buf.dtype == torch.float32, name
    assert torch.isfinite(out.loss)
    # the quantizers read fp32 encoder vectors, not bf16 roundings of them, and their losses are fp32
    for quantized in (out.actions, out.world):
        assert quantized.inputs.dtype == torch.float32 and quantized.commit_loss.dtype == torch.float32
    layer = model.action_encoder.to_code
    expected = h[:, :-1].float().mean(dim=2) @ layer.weight.detach().t() + layer.bias.detach()
    assert torch.allclose(out.actions.inputs, expected, atol=1e-5)
    assert not torch.equal(out.actions.inputs, out.actions.inputs.bfloat16().float())  # not a bf16 linear's output


def test_bf16_weights_feed_the_quantizers_fp32_vectors():
    """Half-precision weights (DeepSpeed's bf16): the code projections still give the quantizers fp32 vectors,
    and the fp32 codes are cast back where they enter the predictor."""
    model = tiny_model().bfloat16()
    out = model.compute(clip(T=5).bfloat16(), step=0, t0=0)
    out.loss.backward()
    assert torch.isfinite(out.loss) and out.predictions[0].dtype == torch.bfloat16
    for quantized in (out.actions, out.world):
        assert quantized.inputs.dtype == torch.float32 and quantized.quantized.dtype == torch.float32
    assert model.action_encoder.to_code.weight.grad.dtype == torch.bfloat16


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------
def test_bad_inputs_name_the_argument():
    model = tiny_model().eval()
    with pytest.raises(ValueError, match=r"x: expected shape \[B, T, 4, 8, 8\]"):
        model(torch.zeros(2, 6, 3, 8, 8), step=0)
    with pytest.raises(ValueError, match="at least 4 frames"):
        model(clip(T=3), step=0)
    with pytest.raises(ValueError, match="actions"):
        model.predict(clip(T=4), torch.zeros(2, 3, 8), torch.zeros(2, 8))
    with pytest.raises(ValueError, match="world"):
        model.predict(clip(T=4), torch.zeros(2, 4, 8), torch.zeros(8))


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(codebook_sizes_action=()), "codebook_sizes"),
        (dict(codebook_sizes_world=(4, 0)), "codebook_sizes"),
        (dict(d_model=30), "d_model"),
        (dict(height=10), "height"),
        (dict(mask_prob=1.0), "mask_prob"),
        (dict(rollout_weights=()), "rollout_weights"),
        (dict(depth_action=0), "depth"),
        (dict(temporal_attention="flash"), "temporal_attention"),
        (dict(world_curriculum=(-1, 0)), "world_curriculum"),
        (dict(world_curriculum=(5,)), "world_curriculum"),
        (dict(world_contrast=-0.1), "world_contrast"),
        (dict(action_shift=-1), "action_shift"),
    ],
)
def test_bad_config_names_the_field(overrides, field):
    with pytest.raises(ConfigError, match=f"^model\\.net\\.{field}"):  # the dotted path users type
        WorldModel(**{**TINY, **overrides})


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(beta_action=math.inf), "model.net.beta_action must be a finite number, got inf"),
        (dict(rollout_weights=(1.0, math.inf)), "model.net.rollout_weights must be finite numbers, got (1.0, inf)"),
        (dict(rollout_weights=[1.0, math.nan]), "model.net.rollout_weights must be finite numbers, got (1.0, nan)"),
        (dict(mlp_ratio=math.inf), "model.net.mlp_ratio must be a finite number, got inf"),  # was an OverflowError
        (dict(mlp_ratio=0.01), "model.net.mlp_ratio must give an MLP hidden width int(d_model * mlp_ratio) >= 1, "
                               "got 0.01 (width 0 at d_model 32)"),  # was a zero-width MLP
        (dict(mask_prob=math.nan), "model.net.mask_prob must be a finite number, got nan"),
        (dict(ema_decay_end=math.inf), "model.net.ema_decay_end must be a finite number, got inf"),
        (dict(height=18), "model.net.height and model.net.width must be positive multiples of 4 (the tokenizer "
                          "downsamples by 4), got 18x8"),
        (dict(in_channels=0), "model.net.in_channels must be >= 1, got 0"),
        (dict(mlp_ratio=0.0), "model.net.mlp_ratio must be > 0, got 0.0"),
    ],
)
def test_bad_config_is_refused_with_the_dotted_field(overrides, message):
    with pytest.raises(ConfigError) as e:
        WorldModelConfig(**{**TINY, **overrides})
    assert str(e.value) == message


def test_dead_code_steps_that_let_unused_codes_collapse_are_warned():
    with pytest.warns(UserWarning, match=r"^model\.net\.dead_code_steps=120 at an EMA decay of 0\.9"):
        WorldModelConfig(**{**TINY, "dead_code_steps": 120})  # 0.9^120 = 3e-6 < eps 1e-5
    with pytest.warns(UserWarning, match=r"at an EMA decay of 0\.8:"):  # a schedule falling to 0.8: 0.8^100 = 2e-10
        WorldModelConfig(**{**TINY, "ema_decay_start": 0.99, "ema_decay_end": 0.8})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        WorldModelConfig(**{**TINY, "dead_code_steps": 100})  # the default: 0.9^100 = 2.7e-5, 0.73 of the code
        WorldModelConfig(**{**TINY, "dead_code_steps": 300, "ema_decay_steps": 0})  # decay_end 0.99 from step 0


def test_several_problems_are_one_line_each():
    with pytest.raises(ConfigError) as e:
        WorldModelConfig(**{**TINY, "beta_world": math.nan, "depth_world": 0})
    assert str(e.value).splitlines() == ["model.net.beta_world must be a finite number, got nan",
                                         "model.net.depth_world must be >= 1, got 0"]


@pytest.mark.slow
def test_temporal_attention_kernel_reaches_every_temporal_attention_and_gives_the_same_step():
    x = clip(T=6)
    results = []
    for kernel in ("sdpa", "matmul"):
        model = tiny_model(temporal_attention=kernel).train()
        blocks = [b for t in (model.action_encoder.transformer, model.world_encoder.transformer,
                              model.dynamics.transformer) for b in t.blocks]
        assert all(b.temporal.kernel == kernel and b.spatial.kernel == "sdpa" for b in blocks)
        out = model.compute(x, step=None, generator=torch.Generator().manual_seed(1))
        out.loss.backward()
        results.append((out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (l1, g1), *others = results
    for l2, g2 in others:
        assert torch.allclose(l1, l2, rtol=1e-5)
        for name in g1:
            assert torch.allclose(g1[name], g2[name], rtol=1e-4, atol=1e-6), name


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    x = clip(T=6)
    grads, losses, saved = [], [], []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = tiny_model(activation_checkpointing=checkpointing).train()
        assert all(t.checkpointing == checkpointing for t in (model.action_encoder.transformer,
                   model.world_encoder.transformer, model.dynamics.transformer))
        numel = [0]

        def pack(t):  # what autograd keeps for the backward: checkpointed blocks keep only their inputs
            numel[0] += t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model.compute(x, step=None, generator=torch.Generator().manual_seed(1))
        saved.append(numel[0])
        out.loss.backward()
        losses.append(out.loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert torch.equal(losses[0], losses[1])
    assert saved[1] < saved[0] / 2  # far fewer activations kept
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:  # recomputation is the same arithmetic: equal up to float reassociation
        assert torch.allclose(grads[0][name], grads[1][name], rtol=1e-5, atol=1e-7), name


@torch.no_grad()
def test_world_vector_is_the_mean_over_every_frame_and_patch():
    """The world encoder pools its bidirectional transformer's output over time and space (a bidirectional
    encoder makes every position depend on every frame, so the dependence test cannot see a wrong pool)."""
    model = tiny_model().eval().double()
    tokens = torch.randn(2, 6, 4, 32, dtype=torch.float64)
    h, _, _ = model.world_encoder.transformer(tokens)
    expected = model.world_encoder.to_code(h.mean(dim=(1, 2)))
    torch.testing.assert_close(model.world_encoder.embed(tokens).double(), expected)


@pytest.mark.parametrize("max_pool", [False, True])
def test_action_vector_pools_each_transitions_patches_by_mean_or_max(max_pool):
    model = tiny_model(action_input="transition", action_max_pool=max_pool).eval().double()
    tokens = torch.randn(2, 6, 4, 32, dtype=torch.float64)
    h = model.action_encoder.transformer(tokens.flatten(0, 1)[:, None])[0][:, 0].unflatten(0, (2, 6))[:, :-1]
    expected = model.action_encoder.to_code(h.amax(dim=2) if max_pool else h.mean(dim=2))  # [2, 5, Da]
    torch.testing.assert_close(model.action_encoder.embed(tokens), expected.float())  # embed: fp32


@torch.no_grad()
def test_compute_feeds_action_i_at_position_i():
    """After the data-dependent init the actions differ along the clip, so feeding ``a_i`` one position off
    would change the teacher-forced predictions."""
    model = tiny_model()
    x = clip(T=6)
    model.train().compute(x, step=0)  # codebooks from this clip: distinct action codes
    model.eval()
    out = model.compute(x, step=None)
    a, h = out.actions.quantized, out.world.quantized
    assert (out.actions.indices[:, 1:] != out.actions.indices[:, :-1]).any()  # the premise
    torch.testing.assert_close(out.predictions[0], model.predict(x[:, :-1], a, h), atol=1e-5, rtol=0)


def test_training_draws_the_temporal_pe_start():
    """In training the PE start is drawn (``sample_time_offset`` from the step's generator), not 0."""
    model = tiny_model(mask_prob=0.0, max_time_offset=50).train()
    x = clip(T=5)

    def gen():
        return torch.Generator().manual_seed(7)

    drawn = model.sample_time_offset(2, torch.device("cpu"), gen())
    assert drawn.ne(0).any()
    a = model.compute(x, step=None, generator=gen()).loss
    b = model.compute(x, step=None, t0=drawn, generator=gen()).loss
    c = model.compute(x, step=None, t0=0, generator=gen()).loss
    assert torch.equal(a, b) and not torch.allclose(a, c)


def test_the_prediction_loss_alone_reaches_both_encoders():
    """The teacher-forcing MSE alone (no commitment loss) has a gradient in both encoders' code projections
    and transformers: the quantized codes reach the predictor straight-through, not detached."""
    model = tiny_model(mask_prob=0.0).train()
    x = clip(T=6)
    out = model.compute(x, step=0)
    tf = (out.predictions[0] - x[:, 1:]).pow(2).mean()
    params = [model.action_encoder.to_code.weight, model.action_encoder.transformer.blocks[0].temporal.qkv.weight,
              model.world_encoder.to_code.weight, model.world_encoder.transformer.blocks[0].temporal.qkv.weight]
    for g in torch.autograd.grad(tf, params, allow_unused=True):
        assert g is not None and g.abs().amax() > 0


def test_rollout_gradient_flows_through_the_fed_predictions():
    """Rollout pass 1's loss has a gradient with respect to pass 0's predictions that it reads as context."""
    model = tiny_model(mask_prob=0.0).train()
    x = clip(T=6)
    out = model.compute(x, step=None)
    r1 = (out.predictions[1][:, 1:] - x[:, 2:]).pow(2).mean()
    (g,) = torch.autograd.grad(r1, out.predictions[0], allow_unused=True)
    assert g is not None and g[:, :-1].abs().amax() > 0


# --------------------------------------------------------------------------------------------------
# World-token warm-up (world_curriculum): off, then unquantized, then the code
# --------------------------------------------------------------------------------------------------
def test_world_phase_is_a_pure_function_of_the_step():
    model = tiny_model(world_curriculum=(3, 2))
    assert [model.world_phase_at(s) for s in range(7)] == ["off"] * 3 + ["unquantized"] * 2 + ["quantized"] * 2
    assert model.world_phase_at(None) == "quantized"
    assert {tiny_model().world_phase_at(s) for s in (0, 1, 10**6)} == {"quantized"}  # the default: the requirement's


def test_world_input_values_and_gradients_in_each_phase():
    from lwm.modules.rvq import ResidualVectorQuantizer

    rvq = ResidualVectorQuantizer(8, (4, 4)).eval()
    for phase, expected in (("quantized", "code"), ("unquantized", "z"), ("off", "zeros")):
        z = torch.randn(3, 8, requires_grad=True)
        out = rvq(z)
        w = WorldModel.world_input(out, phase)
        want = {"code": out.quantized, "z": z, "zeros": torch.zeros_like(z)}[expected]
        assert torch.allclose(w, want, atol=1e-6)
        if phase == "off":
            assert not w.requires_grad  # the predictor's loss reaches no world encoder
        else:  # straight-through: the predictor's gradient reaches the encoder unchanged
            (w * torch.arange(8.0)).sum().backward()
            assert torch.equal(z.grad, torch.arange(8.0).expand(3, 8))
    assert not torch.allclose(rvq(z).quantized, z, atol=1e-3)  # the code is not the input: the phases differ


def test_without_the_world_token_predictions_do_not_depend_on_the_world_encoder():
    """Phase off: perturbing the world encoder changes no prediction; with the code or unquantized it does."""
    x = clip(T=6)
    for phase, depends in (("off", False), ("unquantized", True), ("quantized", True)):
        model = tiny_model(mask_prob=0.0).eval()
        before = model.compute(x, step=None, t0=0, world_phase=phase).predictions
        with torch.no_grad():
            for p in model.world_encoder.parameters():
                p.add_(torch.randn_like(p) * 0.5)
        after = model.compute(x, step=None, t0=0, world_phase=phase).predictions
        same = all(torch.equal(a, b) for a, b in zip(before, after))
        assert same != depends, phase


@torch.no_grad()
def test_world_encoder_transformer_is_bidirectional():
    """The world encoder's first position sees the last frame (no causal mask; the pooled dependence test cannot tell)."""
    torch.manual_seed(0)
    model = WorldModel(**TINY).eval().double()
    tokens = torch.randn(2, 6, 4, 32, dtype=torch.float64)
    base, _, _ = model.world_encoder.transformer(tokens)
    moved = tokens.clone()
    moved[:, -1] += torch.randn(2, 4, 32, dtype=torch.float64)  # not a constant shift: LayerNorm removes those
    out, _, _ = model.world_encoder.transformer(moved)
    assert (out[:, 0] - base[:, 0]).abs().amax() > 1e-6


def test_commitment_weights_use_each_codes_own_width():
    """beta_a * Da / (C*H*W) for actions and beta_h * Dh / ((T-1)*C*H*W) for the world, with Da != Dh."""
    model = WorldModel(**{**TINY, "d_code_action": 4, "d_code_world": 12}, beta_action=0.3, beta_world=0.7)
    elements = 4 * 8 * 8
    assert model.commitment_weights(6) == pytest.approx((0.3 * 4 / elements, 0.7 * 12 / (5 * elements)), rel=1e-12)


@torch.no_grad()
def test_encode_actions_over_several_chunks_equals_each_window_alone():
    """A clip whose windows go through the encoder in several chunks (window 130, B=2: one window per chunk) gives
    a_i = the last action of frames i+2-W..i+1 encoded alone at positions t0 + frame, T-1 actions in all."""
    torch.manual_seed(0)
    model = WorldModel(in_channels=2, height=8, width=8, d_model=16, n_heads=2, depth_action=1, depth_world=1,
                       depth_dynamics=1, d_code_action=4, d_code_world=4, codebook_sizes_action=(3, 4),
                       codebook_sizes_world=(3,)).eval()
    W, T, t0 = 130, 133, 3  # starts 1, 2, 3 after the first window: 512 // (2 * 130) = 1 window per chunk
    x = torch.rand(2, T, 2, 8, 8, generator=torch.Generator().manual_seed(5)) * 2 - 1
    windowed = model.encode_actions(x, t0=t0, window=W)
    assert windowed.inputs.shape == (2, T - 1, 4)
    for i in range(W - 1, T - 1):
        s = i + 2 - W
        alone = model.action_encoder.embed(model.tokenize(x[:, s : s + W]) + model.pos_embedding(W, t0 + s))
        torch.testing.assert_close(windowed.inputs[:, i], alone[:, -1], rtol=0, atol=1e-5)


def test_the_token_mask_is_drawn_from_the_given_generator_after_the_pe_start():
    model = tiny_model(mask_prob=0.3).train()
    x = clip(B=2, T=5)
    masks = []
    for seed in (1, 2):  # whatever the global RNG
        torch.manual_seed(seed)
        with torch.no_grad():
            masks.append(model.compute(x, step=None, generator=torch.Generator().manual_seed(7)).token_mask)
    assert masks[0].any() and torch.equal(masks[0], masks[1])
    g = torch.Generator().manual_seed(7)
    model.sample_time_offset(2, torch.device("cpu"), g)
    assert torch.equal(masks[0], torch.rand(2, 5, model.grid[0] * model.grid[1], generator=g) < 0.3)


@torch.no_grad()
def test_an_untrained_residual_model_copies_the_last_frame():
    """With ``residual`` the predictor outputs the change from the frame it was fed: at init (the detokenizer's
    last layer at zero) every prediction, teacher-forced, rolled out or generated, is the frame before."""
    model = tiny_model(residual=True).eval()
    x = clip(T=6)
    out = model.compute(x, step=None)
    for pred in out.predictions:
        assert torch.equal(pred[:, 0], x[:, 0])
    assert torch.equal(out.predictions[0], x[:, :-1])
    a, h = torch.randn(2, 8, 8), torch.randn(2, 8)
    assert torch.equal(model.generate(x[:, :1], a, h, steps=4), x[:, :1].expand(-1, 4, -1, -1, -1))


def test_an_action_tokenizer_of_its_own_feeds_only_the_action_encoder():
    model = tiny_model(action_input="transition")
    x = clip(T=6)
    shared = model.tokenize(x)
    own = model.action_tokens(x)
    assert own.shape == shared.shape
    model.compute(x, step=0, generator=torch.Generator().manual_seed(0)).loss.backward()
    assert all(p.grad is not None for p in model.action_tokenizer.parameters())


def test_world_frames_limits_what_the_world_code_sees():
    model = tiny_model(world_frames=2).eval().double()
    x = clip(T=6).double()
    base = model.encode_world(x).inputs
    for j in range(6):
        x2 = x.clone()
        x2[:, j] += 0.5
        assert ((model.encode_world(x2).inputs - base).abs().amax() > 1e-10) == (j < 2), f"frame {j}"


def test_without_its_spatial_pe_the_action_encoder_reads_only_the_temporal_one():
    with_pe, without = tiny_model(), tiny_model(action_spatial_pe=False)
    x = clip(T=5)
    assert torch.allclose(with_pe.action_tokens(x, 3) - without.action_tokens(x, 3), with_pe.spatial_pe, atol=1e-6)


@torch.no_grad()
def test_context_dropout_makes_each_prediction_depend_on_its_own_frame_alone():
    # (one code per level: the codes are the same whatever the frames, so only the predictor's reading can differ)
    model = tiny_model(context_dropout=1.0, mask_prob=0.0, codebook_sizes_action=(1,), codebook_sizes_world=(1,))
    model = model.train().double()
    x = clip(T=6).double()
    base = model.compute(x, step=None, t0=0).predictions[0]
    x2 = x.clone()
    x2[:, 2] += 0.5
    moved = model.compute(x2, step=None, t0=0).predictions[0]  # position p predicts frame p+1 from frame p alone
    assert _changed(moved, base).tolist() == [False, False, True, False, False]
    model.eval()  # evaluation: every frame before
    assert _changed(model.compute(x2, step=None, t0=0).predictions[0], model.compute(x, step=None, t0=0).predictions[0]
                    ).tolist() == [False, False, True, True, True]


def test_world_contrast_of_identical_clips_is_log_batch_size():
    # every clip the same: each clip's first-frames vector is as similar to every clip's last-frames vector as to its own
    model = tiny_model(world_contrast=0.1, world_frames=1).eval()
    tokens = model.tokenize(clip(B=1, T=6)).expand(5, -1, -1, -1)
    assert torch.allclose(model.world_contrast_loss(tokens), torch.tensor(math.log(5)), atol=1e-5)


def test_world_contrast_trains_the_world_encoder_alone_and_is_logged():
    def run(weight):  # (the model made right before its step: the quantizers' first call draws from the global RNG)
        model = tiny_model(world_contrast=weight, world_frames=1)
        out = model.compute(clip(B=4, T=6), step=0, t0=0, generator=torch.Generator().manual_seed(0))
        out.loss.backward()
        return model, out

    (with_contrast, out), (without, _) = run(0.5), run(0.0)
    assert out.logs["World_Encoder/contrast_loss"] > 0
    assert list(out.logs) == with_contrast.log_keys
    changed = {name for (name, p), q in zip(with_contrast.named_parameters(), without.parameters())
               if p.grad is not None and not torch.equal(p.grad, q.grad)}
    assert changed and all(name.startswith("world_encoder.") for name in changed)


def test_random_roll_rolls_each_clip_by_its_own_shift():
    x = clip(B=3, T=2)
    rolled = WorldModel.random_roll(x, 3, torch.Generator().manual_seed(0))
    shifts = torch.randint(0, 4, (2, 3, 1), generator=torch.Generator().manual_seed(0))
    for b in range(3):
        assert torch.equal(rolled[b], x[b].roll((int(shifts[0, b]), int(shifts[1, b])), dims=(-2, -1)))


@pytest.mark.parametrize("action_input", ["tokens", "transition"])
@torch.no_grad()
def test_action_shift_rolls_what_the_action_encoder_reads_in_training_only(action_input):
    model = tiny_model(action_input=action_input, action_shift=3, mask_prob=0.0)
    x = clip(B=4, T=5)
    codes = model.compute(x, step=None, t0=0, generator=torch.Generator().manual_seed(5)).actions.inputs
    rolled = WorldModel.random_roll(x, 3, torch.Generator().manual_seed(5))  # the first draw of the step
    assert not torch.equal(rolled, x)
    torch.testing.assert_close(codes, model.action_encoder(model.action_tokens(rolled, 0)).inputs, rtol=0, atol=1e-6)
    model.eval()
    torch.testing.assert_close(model.compute(x, step=None, t0=0).actions.inputs, model.encode_actions(x).inputs,
                               rtol=0, atol=1e-6)


def test_the_label_head_learns_from_the_labelled_transitions_only():
    x = clip(B=2, T=5)
    labels = torch.tensor([[0, 1, -1, 2, 3], [-1, -1, -1, -1, -1]])  # a_i is the action after frame i; the last unused
    model = tiny_model(action_labels=3, label_weight=0.5, mask_prob=0.0).train()
    out = model.compute(x, step=0, t0=0, generator=torch.Generator().manual_seed(0), labels=labels)
    logits = model.label_head(out.actions.inputs.float())  # the vectors before quantization
    expected = torch.nn.functional.cross_entropy(logits[0, [0, 1, 3]], torch.tensor([0, 1, 2]))
    assert torch.allclose(out.logs["Action_Encoder/label_loss"], expected)
    accuracy = (logits[0, [0, 1, 3]].argmax(-1) == torch.tensor([0, 1, 2])).float().mean()
    assert torch.allclose(out.logs["Action_Encoder/label_accuracy"], accuracy)
    # no label in the batch: the head adds nothing
    none = tiny_model(action_labels=3, label_weight=0.5, mask_prob=0.0).train().compute(
        x, step=0, t0=0, generator=torch.Generator().manual_seed(0), labels=torch.full((2, 5), -1))
    assert torch.equal(none.logs["Action_Encoder/label_loss"], torch.tensor(0.0))
    assert torch.allclose(out.loss, none.loss + 0.5 * expected)
    plain = tiny_model(mask_prob=0.0).train().compute(x, step=0, t0=0, generator=torch.Generator().manual_seed(0))
    assert torch.equal(none.logs["Dynamics_Predictor/prediction_loss"], plain.logs["Dynamics_Predictor/prediction_loss"])
    # the head's gradient reaches the action encoder as if it read the encoder's output itself
    head = model.label_loss(model.unquantized(out.actions), labels, 2, 5)[0]
    direct = torch.nn.functional.cross_entropy(
        model.label_head(model.action_encoder.embed(model.action_tokens(x, 0)))[0, [0, 1, 3]], torch.tensor([0, 1, 2]))
    weight = model.action_encoder.to_code.weight
    (through,), (alone,) = torch.autograd.grad(head, weight), torch.autograd.grad(direct, weight)
    assert alone.abs().sum() > 0
    torch.testing.assert_close(through, alone)


def test_a_checkpoints_retired_fields_load_at_their_defaults_only():
    fields = {**TINY, "fusion": "add", "change_weight": 0.0}
    assert WorldModelConfig.from_dict(fields) == WorldModelConfig(**TINY)
    with pytest.raises(ConfigError, match="^model\\.net: fusion='film'"):
        WorldModelConfig.from_dict({**fields, "fusion": "film"})
    assert WorldModelConfig.from_dict({**TINY, "temporal_attention": "triton"}) == WorldModelConfig(**TINY)
