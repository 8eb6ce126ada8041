"""The requirement's world model: action encoder, world encoder, dynamics predictor, and the WorldModel
that owns the shared tokenizer/detokenizer, computes the training loss and plays the model forward.

Conventions (see DESIGN.md, "Points the requirement leaves open"):

* ``a_i`` summarises the transition ``i -> i+1`` (``i = 0..T-2``). The action encoder's first block uses
  the ``shifted_causal`` mask and the others ``causal``, so ``a_i`` depends on frames ``0..i+1`` and no
  later, whatever the depth.
* ``a_i`` is added to the predictor's input token at position ``i``, whose output predicts frame ``i+1``;
  the predictor is causal, so its output ``i`` depends on frames and actions ``0..i`` only.
* The world code ``h`` pools a bidirectional transformer over space and time: it sees every frame.
* Rollout: pass 1 is teacher forcing; pass ``k+1`` feeds ``[x_0, pred_k(1..T-2)]`` with the same
  actions, world code and token mask, and its loss skips the first ``k`` positions (which equal pass
  ``k``'s, the requirement's proof). Those positions are not recomputed: pass ``k+1`` runs the predictor
  on the later positions only, attending to pass ``k``'s temporal keys/values of the first ``k``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import Tensor, nn

from lwm.utils.errors import ConfigError
from lwm.modules import triton_attention
from lwm.modules.rvq import RVQ_EPS, ResidualVectorQuantizer, RVQOutput
from lwm.modules.st_transformer import (
    ATTENTION_KERNELS,
    KV,
    Attention,
    AttentionKernel,
    Detokenizer,
    STTransformer,
    Tokenizer,
    spatial_pos_embedding,
    temporal_pos_embedding,
    to_maps,
    to_sequence,
)


@dataclass
class WorldModelOutput:
    loss: Tensor  # scalar total loss (differentiable)
    logs: dict[str, Tensor]  # detached scalars, keys "<Namespace>/<name>" (the caller adds Train_/Val_)
    actions: RVQOutput  # quantized [B, T-1, Da], indices [B, T-1, La]
    world: RVQOutput  # quantized [B, Dh], indices [B, Lh]
    predictions: list[Tensor]  # one per pass (TF, rollout 1, ...), each [B, T-1, C, H, W] predicting frames 1..T-1
    token_mask: Tensor | None  # [B, T, N] True where a token was replaced by the mask token (None: no masking)


def to_weight_dtype(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` in the weights' ``dtype`` where that is not fp32 (bf16 weights under DeepSpeed take no fp32 input;
    float64 in tests); unchanged next to fp32 weights, where autocast (bf16-mixed) casts what it needs itself."""
    return x if dtype == torch.float32 or x.dtype == dtype else x.to(dtype)


def code_projection(layer: nn.Linear, h: Tensor) -> Tensor:
    """``layer(h)`` in fp32 under any autocast or weight dtype: the encoder vector the fp32 quantizer reads (its
    EMA sums and commitment loss), not a bf16 rounding of it. ``h`` is the pooled ``[..., D]``, so it is cheap."""
    with torch.autocast(device_type=h.device.type, enabled=False):
        bias = None if layer.bias is None else layer.bias.float()
        return nn.functional.linear(h.float(), layer.weight.float(), bias)


class ActionEncoder(nn.Module):
    """ST transformer with exactly one frame of lookahead, spatial mean-pool, RVQ: tokens -> ``[B, T-1, Da]``.
    ``st``: :class:`STTransformer` options (``checkpointing``, ``temporal_attention``); ``rvq``: the quantizer's."""

    def __init__(
        self, d_model: int, n_heads: int, depth: int, d_code: int, codebook_sizes: Sequence[int],
        mlp_ratio: float = 4.0, st: dict | None = None, lookahead: bool = True, per_transition: bool = False,
        **rvq_kwargs,
    ) -> None:
        super().__init__()
        # The shift is applied once: stacking shifted masks would let output i see frame i + depth. Without
        # ``lookahead`` every block is causal. ``per_transition``: each input frame is read alone (it holds the whole
        # transition: the frame beside its change to the next), no history.
        masks = ["shifted_causal" if lookahead else "causal"] + ["causal"] * (depth - 1)
        self.per_transition = per_transition
        self.transformer = STTransformer(d_model, n_heads, masks, mlp_ratio, **(st or {}))
        self.to_code = nn.Linear(d_model, d_code)
        self.rvq = ResidualVectorQuantizer(d_code, codebook_sizes, **rvq_kwargs)

    def embed(self, tokens: Tensor) -> Tensor:
        """Pre-quantization action vectors ``[B, T-1, Da]`` in fp32."""
        if self.per_transition:
            h = self.transformer(tokens.flatten(0, 1)[:, None])[0][:, 0].unflatten(0, tokens.shape[:2])
        else:
            h, _, _ = self.transformer(tokens)  # [B, T, N, D]; position i has seen frames 0..i+1
        return code_projection(self.to_code, h[:, :-1].mean(dim=2, dtype=torch.float32))  # [B, T-1, Da]

    def attention(self, tokens: Tensor) -> list[Tensor]:
        """Per-block temporal attention weights ``[B, heads, T, T]``, averaged over patches (diagnostics; reading
        each transition alone, every frame attends to itself only)."""
        if self.per_transition:
            B, T = tokens.shape[:2]
            eye = torch.eye(T, device=tokens.device).expand(B, self.transformer.blocks[0].temporal.n_heads, T, T)
            return [eye] * len(self.transformer.blocks)
        return self.transformer(tokens, return_attn=True)[1]

    def forward(self, tokens: Tensor, step: int | Tensor | None = None) -> RVQOutput:
        return self.rvq(self.embed(tokens), step)


class WorldEncoder(nn.Module):
    """Bidirectional ST transformer, mean-pool over space and time, RVQ: tokens -> ``[B, Dh]``."""

    def __init__(
        self, d_model: int, n_heads: int, depth: int, d_code: int, codebook_sizes: Sequence[int],
        mlp_ratio: float = 4.0, st: dict | None = None, **rvq_kwargs,
    ) -> None:
        super().__init__()
        self.transformer = STTransformer(d_model, n_heads, ["none"] * depth, mlp_ratio, **(st or {}))
        self.to_code = nn.Linear(d_model, d_code)
        self.rvq = ResidualVectorQuantizer(d_code, codebook_sizes, **rvq_kwargs)

    def embed(self, tokens: Tensor) -> Tensor:
        """Pre-quantization world vector ``[B, Dh]`` in fp32."""
        h, _, _ = self.transformer(tokens)  # [B, T, N, D]
        return code_projection(self.to_code, h.mean(dim=(1, 2), dtype=torch.float32))  # [B, Dh]

    def forward(self, tokens: Tensor, step: int | Tensor | None = None) -> RVQOutput:
        return self.rvq(self.embed(tokens), step)


class DynamicsPredictor(nn.Module):
    """Causal ST transformer on state tokens plus ``W_a a + W_h h`` broadcast over patches.

    ``a`` and ``h`` are the quantizers' outputs, the *sum* of the level codes (``[.., Da]``, ``[.., Dh]``), where the
    requirement writes the levels concatenated (``n_code * d_code``); DESIGN.md decides the sum (the RVQ's
    output, as in every residual VQ)."""

    def __init__(self, d_model: int, n_heads: int, depth: int, d_action: int, d_world: int, mlp_ratio: float = 4.0,
                 st: dict | None = None) -> None:
        super().__init__()
        self.action_proj = nn.Linear(d_action, d_model)  # W_a^z
        self.world_proj = nn.Linear(d_world, d_model)  # W_h^z
        self.transformer = STTransformer(d_model, n_heads, ["causal"] * depth, mlp_ratio, **(st or {}))

    def condition(self, actions: Tensor, world: Tensor) -> Tensor:
        """``W_a a + W_h h`` for ``actions [B, t, Da]``, ``world [B, Dh]``: ``[B, t, 1, D]`` (broadcast over patches).
        The codes (fp32 codebook entries) are cast to half-precision weights (DeepSpeed's bf16)."""
        actions = to_weight_dtype(actions, self.action_proj.weight.dtype)
        world = to_weight_dtype(world, self.world_proj.weight.dtype)
        return self.action_proj(actions)[:, :, None] + self.world_proj(world)[:, None, None]

    def forward(
        self, tokens: Tensor, actions: Tensor, world: Tensor, window: int | None = None, past: list[KV] | None = None
    ) -> tuple[Tensor, list[KV]]:
        """``tokens [B, t, N, D]``, ``actions [B, t, Da]``, ``world [B, Dh]`` -> (``[B, t, N, D]``, per-block
        temporal keys/values); output ``i`` is the prediction of frame ``i + 1``. ``window``: each block attends to the
        last ``window`` frames only (per block: stacked, an output depends on up to ``depth * (window - 1) + 1``
        frames, as in any sliding-window attention). ``past``: per-block keys/values of ``p`` earlier frames that ``tokens`` follow
        (output ``i`` then predicts frame ``p + i + 1``)."""
        out, _, cache = self.transformer(tokens + self.condition(actions, world), window=window, past=past)
        return out, cache

    def step(
        self, token: Tensor, action: Tensor, world: Tensor, cache: list[KV] | None, window: int | None = None
    ) -> tuple[Tensor, list[KV]]:
        """One new frame: ``token [B, 1, N, D]``, ``action [B, 1, Da]`` -> (its output ``[B, 1, N, D]``, the
        updated key/value cache); equal to the last output of :meth:`forward` on the whole sequence."""
        return self.transformer.step(token + self.condition(action, world), cache, window)


ACTION_INPUTS = ("tokens", "transition")


@dataclass(frozen=True)
class WorldModelConfig:
    """Every hyperparameter of :class:`WorldModel`; the defaults are the requirement's."""

    in_channels: int = 16  # latent channels C
    height: int = 64  # latent height H (divisible by 4: the tokenizer downsamples by 4)
    width: int = 64  # latent width W (divisible by 4)
    d_model: int = 512  # token width D (divisible by 4 and by n_heads)
    n_heads: int = 8  # attention heads in every ST transformer
    depth_action: int = 3  # ST blocks of the action encoder
    depth_world: int = 3  # ST blocks of the world encoder
    depth_dynamics: int = 3  # ST blocks of the dynamics predictor
    mlp_ratio: float = 4.0  # MLP hidden width / D
    tokenizer_hidden: int | None = None  # channels inside the CNN tokenizer/detokenizer (None: max(D/2, 16))
    d_code_action: int = 32  # action code width Da
    d_code_world: int = 64  # world code width Dh
    codebook_sizes_action: tuple[int, ...] = (12, 64, 256)  # codes per RVQ level, action quantizer
    codebook_sizes_world: tuple[int, ...] = (12, 24, 48, 256, 256, 256)  # codes per RVQ level, world quantizer
    beta_action: float = 0.25  # beta_a of the requirement's summed loss (per-element weight: see commitment_weights)
    beta_world: float = 0.25  # beta_h of the requirement's summed loss (per-element weight: see commitment_weights)
    mask_prob: float = 0.1  # Bernoulli token-mask probability (world encoder + predictor inputs, training only)
    rollout_weights: tuple[float, ...] = (1.0, 0.8, 0.5)  # loss weights of (TF, rollout 1, rollout 2, ...)
    max_time_offset: int = 256  # training draws the temporal-PE start uniformly from [0, max_time_offset]
    ema_decay_start: float = 0.9  # EMA decay of both quantizers at step 0
    ema_decay_end: float = 0.99  # EMA decay from ema_decay_steps on (linear in between)
    ema_decay_steps: int = 5000  # length of the EMA decay schedule, in global steps
    dead_code_steps: int = 100  # a code unused for this many updates is dead (replaced by ``revive``)
    activation_checkpointing: bool = False  # recompute every ST block's activations in the backward: less memory
    temporal_attention: str = "sdpa"  # temporal attention kernel: sdpa | matmul | triton (the same function; speed differs)
    # Optional world-token warm-up (not the requirement's, off by default): the predictor first trains this many
    # steps without the world token, then this many with the world encoder's output unquantized, then with the code.
    world_curriculum: tuple[int, int] = (0, 0)
    # Not the requirement's (off by default): the predictor outputs the change from the frame it was fed, so an
    # untrained model copies the last frame (its detokenizer's last layer starts at zero).
    residual: bool = False
    # What the action encoder reads: "tokens" (the shared tokenizer's, the requirement's), or "transition": a
    # tokenizer of its own on each frame beside its change to the next, each transition alone (Genie's latent action
    # model reads pixels, not the dynamics' tokens; without the frames before, its code cannot say "as before").
    action_input: str = "tokens"
    action_spatial_pe: bool = True  # the action encoder's tokens get the spatial PE (without: its code cannot say where)
    # Not the requirement's (0: off): in training the action encoder reads each clip rolled by a random spatial shift
    # of 0..action_shift latent cells per axis. A code that named where in its token a change falls (the strided
    # tokenizer tells the phase) would then mislead the predictor, which sees the clip unshifted: the code must say
    # how things move.
    action_shift: int = 0
    # The frames the world encoder reads: the first world_frames of a clip (None: all of them, the requirement's). A
    # world code that sees the frames it helps predict can carry them rather than the world.
    world_frames: int | None = None
    # The probability that a training step's predictor sees each frame alone, without the frames before it: the codes
    # must then carry the whole transition (a sticky policy's history otherwise tells much of the next action).
    context_dropout: float = 0.0
    # Not the requirement's (0: off): the weight of a contrastive loss (InfoNCE, against the batch's other clips) that
    # makes the world vectors of a clip's first and last frames agree: the code must carry what stays the same along
    # a clip, the world, even where the predictor reads the world from the frames. It trains the world encoder alone.
    world_contrast: float = 0.0
    # Not the requirement's (0: off): the number of true action classes a linear head reads from each action code,
    # trained by cross-entropy on the transitions whose label the batch keeps (data.label_fraction):
    # a few labels tell the action code what to name (LAOM's semi-supervision). Unlabelled transitions (-1) add nothing.
    action_labels: int = 0
    label_weight: float = 0.1  # the head's cross-entropy weight in the loss

    # The fields that decide the parameters' and buffers' shapes (a checkpoint loads only where they agree).
    SHAPE_FIELDS: ClassVar[tuple[str, ...]] = (
        "in_channels", "height", "width", "d_model", "n_heads", "depth_action", "depth_world", "depth_dynamics",
        "mlp_ratio", "tokenizer_hidden", "d_code_action", "d_code_world", "codebook_sizes_action",
        "codebook_sizes_world", "action_labels")

    # Fields of earlier versions, deleted with the setting they had by default: a checkpoint that holds them loads
    # where it kept that setting.
    RETIRED: ClassVar[dict[str, object]] = {"fusion": "add", "change_weight": 0.0}

    @classmethod
    def from_dict(cls, fields: dict) -> "WorldModelConfig":
        """A checkpoint's ``net`` hyperparameters as a config (its retired fields at their defaults dropped)."""
        changed = [f"{k}={v!r}" for k, v in fields.items() if k in cls.RETIRED and v != cls.RETIRED[k]]
        if changed:
            raise ConfigError(f"model.net: {', '.join(changed)} is no longer an option of this lwm version")
        return cls(**{k: v for k, v in fields.items() if k not in cls.RETIRED})

    @property
    def grid(self) -> tuple[int, int]:
        """The token grid ``(Hp, Wp)``: the CNN tokenizer downsamples by ``Tokenizer.DOWNSAMPLE`` (4)."""
        return self.height // Tokenizer.DOWNSAMPLE, self.width // Tokenizer.DOWNSAMPLE

    @property
    def min_frames(self) -> int:
        """The shortest training clip: every rollout pass needs one position left to score."""
        return len(self.rollout_weights) + 1

    def __post_init__(self) -> None:
        """Refuse an invalid configuration, one line per problem naming the field (``model.net.X``)."""
        problems = _config_problems(self)
        if problems:
            raise ConfigError("\n".join(f"model.net.{p}" for p in problems))
        _warn_if_unused_codes_shrink(self)


def _config_problems(c: WorldModelConfig) -> list[str]:
    """Every problem of a configuration, one line each naming its field (without the ``model.net.`` prefix)."""
    nonfinite = [name for name in c.__dataclass_fields__ if _nonfinite(getattr(c, name))]
    problems = []
    for name in nonfinite:  # (the range checks below skip these)
        value = getattr(c, name)
        what = "finite numbers" if isinstance(value, (tuple, list)) else "a finite number"
        problems.append(f"{name} must be {what}, got {_as_tuples(value)}")
    down = Tokenizer.DOWNSAMPLE
    if c.height % down or c.width % down or min(c.height, c.width) < down:
        problems.append(f"height and model.net.width must be positive multiples of {down} (the tokenizer "
                        f"downsamples by {down}), got {c.height}x{c.width}")
    if c.d_model < 4 or c.d_model % 4 or c.n_heads < 1 or c.d_model % c.n_heads:
        problems.append(f"d_model must be divisible by 4 and by n_heads ({c.n_heads}), got {c.d_model}")
    if c.action_shift < 0:
        problems.append(f"action_shift must be >= 0, got {c.action_shift}")
    for name in ("in_channels", "depth_action", "depth_world", "depth_dynamics", "d_code_action", "d_code_world",
                 "ema_decay_steps", "dead_code_steps"):
        lowest = 0 if name == "ema_decay_steps" else 1
        if getattr(c, name) < lowest:
            problems.append(f"{name} must be >= {lowest}, got {getattr(c, name)}")
    for name in ("codebook_sizes_action", "codebook_sizes_world"):
        sizes = tuple(getattr(c, name))
        if not sizes or any(int(k) < 1 for k in sizes):
            problems.append(f"{name} needs at least one level and at least one code per level, got {sizes}")
    if c.tokenizer_hidden is not None and c.tokenizer_hidden < 1:
        problems.append(f"tokenizer_hidden must be >= 1 (or null: max(d_model/2, 16)), got {c.tokenizer_hidden}")
    if "mlp_ratio" not in nonfinite:
        if not c.mlp_ratio > 0:
            problems.append(f"mlp_ratio must be > 0, got {c.mlp_ratio}")
        elif c.d_model >= 1 and int(c.d_model * c.mlp_ratio) < 1:  # (the MLP's hidden width)
            problems.append(f"mlp_ratio must give an MLP hidden width int(d_model * mlp_ratio) >= 1, got "
                            f"{c.mlp_ratio} (width {int(c.d_model * c.mlp_ratio)} at d_model {c.d_model})")
    if c.action_labels < 0:
        problems.append(f"action_labels must be >= 0 (0: no label head), got {c.action_labels}")
    for name in ("beta_action", "beta_world", "world_contrast", "label_weight"):
        if name not in nonfinite and not getattr(c, name) >= 0:
            problems.append(f"{name} must be >= 0, got {getattr(c, name)}")
    if "context_dropout" not in nonfinite and not 0.0 <= c.context_dropout <= 1.0:
        problems.append(f"context_dropout must lie in [0, 1], got {c.context_dropout}")
    if "mask_prob" not in nonfinite and not 0.0 <= c.mask_prob < 1.0:
        problems.append(f"mask_prob must lie in [0, 1), got {c.mask_prob}")
    if not c.rollout_weights:
        problems.append("rollout_weights needs at least the teacher-forcing weight")
    elif "rollout_weights" not in nonfinite and (not all(w >= 0 for w in c.rollout_weights)
                                                 or not any(w > 0 for w in c.rollout_weights)):
        problems.append(f"rollout_weights must be >= 0, not all 0, got {_as_tuples(c.rollout_weights)}")
    if c.max_time_offset < 0:
        problems.append(f"max_time_offset must be >= 0, got {c.max_time_offset}")
    for name in ("ema_decay_start", "ema_decay_end"):
        if name not in nonfinite and not 0.0 <= getattr(c, name) < 1.0:
            problems.append(f"{name} must lie in [0, 1), got {getattr(c, name)}")
    if len(c.world_curriculum) != 2 or any(int(n) < 0 for n in c.world_curriculum):
        problems.append(f"world_curriculum must be two step counts >= 0 (without, then unquantized), got "
                        f"{tuple(c.world_curriculum)}")
    if c.world_frames is not None and c.world_frames < 1:
        problems.append(f"world_frames must be >= 1 (or null: every frame), got {c.world_frames}")
    if c.action_input not in ACTION_INPUTS:
        problems.append(f"action_input must be one of {ACTION_INPUTS}, got {c.action_input!r}")
    if c.temporal_attention not in ATTENTION_KERNELS:
        problems.append(f"temporal_attention must be one of {ATTENTION_KERNELS}, got {c.temporal_attention!r}")
    return problems


def _warn_if_unused_codes_shrink(c: WorldModelConfig) -> None:
    """Warn where a code unused for ``dead_code_steps`` updates shrinks towards zero before it counts as dead."""
    decay = min(c.ema_decay_start, c.ema_decay_end) if c.ema_decay_steps else c.ema_decay_end
    if decay ** c.dead_code_steps < RVQ_EPS:  # see lwm/modules/rvq.py: unused codes shrink by g^t/(g^t+eps)
        warnings.warn(f"model.net.dead_code_steps={c.dead_code_steps} at an EMA decay of {decay}: a code "
                      f"unused that long shrinks below half its length (decay^steps < eps = {RVQ_EPS}) before it "
                      f"counts as dead and is revived; unused codes drift to zero. Fewer dead_code_steps or a "
                      f"higher ema_decay_start avoid it", stacklevel=4)  # the caller of WorldModelConfig(...)


def _kv_prefix(cache: list[KV], length: int) -> list[KV]:
    """Each block's temporal keys/values of the first ``length`` positions, copied (not views of the rest)."""
    return [(keys[:, :, :length].clone(), values[:, :, :length].clone()) for keys, values in cache]


def _nonfinite(value: object) -> bool:
    """Whether a float field (or a tuple field's float) is inf or nan."""
    values = value if isinstance(value, (tuple, list)) else (value,)
    return any(isinstance(v, float) and not math.isfinite(v) for v in values)


def _as_tuples(value: object) -> object:
    """A tuple field as a tuple (configs give lists), for messages."""
    return tuple(value) if isinstance(value, list) else value



@contextmanager
def _setting(objects: Sequence[object], name: str, value: object) -> Iterator[None]:
    """Each of ``objects``' attribute ``name`` set to ``value`` inside the block, as it was after it."""
    saved = [getattr(o, name) for o in objects]
    for o in objects:
        setattr(o, name, value)
    try:
        yield
    finally:
        for o, was in zip(objects, saved):
            setattr(o, name, was)

class WorldModel(nn.Module):
    """Latent world model on Video-VAE latents ``x [B, T, C, H, W]`` in [-1, 1].

    ``WorldModel(config)`` or ``WorldModel(**fields)`` or both (keywords override the config's fields); the
    fields and their meaning are :class:`WorldModelConfig`'s.
    """

    def __init__(self, config: WorldModelConfig | None = None, **overrides) -> None:
        unknown = set(overrides) - set(WorldModelConfig.__dataclass_fields__)
        if unknown:
            raise TypeError(f"WorldModel: unknown argument(s) {sorted(unknown)}")
        c = replace(config or WorldModelConfig(), **overrides)
        super().__init__()
        self.config = c  # every hyperparameter is read from here
        self.grid = c.grid  # the token grid (Hp, Wp)
        rvq = dict(decay_start=c.ema_decay_start, decay_end=c.ema_decay_end, decay_steps=c.ema_decay_steps,
                   dead_code_steps=c.dead_code_steps)
        st = dict(checkpointing=c.activation_checkpointing, temporal_attention=c.temporal_attention)

        self.tokenizer = Tokenizer(c.in_channels, c.d_model, c.tokenizer_hidden)
        if c.action_input != "tokens":  # the action encoder's own tokenizer
            self.action_tokenizer = Tokenizer(2 * c.in_channels, c.d_model, c.tokenizer_hidden)
        self.detokenizer = Detokenizer(c.in_channels, c.d_model, c.tokenizer_hidden)
        self.action_encoder = ActionEncoder(c.d_model, c.n_heads, c.depth_action, c.d_code_action,
                                            c.codebook_sizes_action, c.mlp_ratio, st,
                                            lookahead=c.action_input == "tokens",
                                            per_transition=c.action_input == "transition", **rvq)
        self.world_encoder = WorldEncoder(c.d_model, c.n_heads, c.depth_world, c.d_code_world,
                                          c.codebook_sizes_world, c.mlp_ratio, st, **rvq)
        self.dynamics = DynamicsPredictor(c.d_model, c.n_heads, c.depth_dynamics, c.d_code_action, c.d_code_world,
                                          c.mlp_ratio, st)
        # Never used when mask_prob is 0: frozen then, so that DDP (find_unused_parameters=False) finds no
        # parameter without a gradient.
        self.mask_token = nn.Parameter(torch.randn(c.d_model) * 0.02, requires_grad=c.mask_prob > 0)
        self.register_buffer("spatial_pe", spatial_pos_embedding(*self.grid, c.d_model), persistent=False)  # [N, D]
        self.apply(self._init_weights)
        # The projections into and out of the small code spaces keep unit scale (std 1/sqrt(fan_in)) rather than
        # the 0.02 of the rest: with 0.02 the codes' effect on the predictor's tokens (W_a a + W_h h) starts well
        # below the tokens (30-70x at configs/tiny.yaml, 4x at the defaults), and on the synthetic world the
        # world code learned far slower.
        for layer in (self.action_encoder.to_code, self.world_encoder.to_code, self.dynamics.action_proj,
                      self.dynamics.world_proj):
            nn.init.normal_(layer.weight, std=layer.in_features**-0.5)
        if c.residual:
            last = self.detokenizer.net[-1]
            nn.init.zeros_(last.weight)
            nn.init.zeros_(last.bias)
        if c.action_labels:  # made last: the other weights are those of the same model without it
            self.label_head = nn.Linear(c.d_code_action, c.action_labels)
        if c.temporal_attention == "triton" and triton_attention.triton is None:
            warnings.warn("temporal_attention=triton: the triton package is not installed, so temporal attention runs "
                          "as plain matmuls (the same function, slower)", stacklevel=2)

    @contextmanager
    def checkpointing(self, on: bool) -> Iterator[None]:
        """Activation checkpointing of every ST transformer set to ``on`` inside the block (e.g. off while
        counting FLOPs: the recomputed forward is not useful work), as configured after it."""
        transformers = (self.action_encoder.transformer, self.world_encoder.transformer, self.dynamics.transformer)
        with _setting(transformers, "checkpointing", on):
            yield

    @contextmanager
    def attention_kernel(self, kernel: AttentionKernel) -> Iterator[None]:
        """Every attention's kernel set to ``kernel`` inside the block, as configured after it."""
        with _setting([m for m in self.modules() if isinstance(m, Attention)], "kernel", kernel):
            yield

    @contextmanager
    def counting_form(self) -> Iterator[None]:
        """The model in the form whose FLOP count is the step's useful work (``lwm bench``, the ``flops``
        callback), inside the block: no activation checkpointing (its recomputed forward is not useful work) and
        attention by SDPA (counted for the pairs the mask allows; the matmul kernel's count includes the pairs the
        mask drops). The same function either way."""
        with self.checkpointing(False), self.attention_kernel("sdpa"):
            yield

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    @property
    def min_frames(self) -> int:
        """The shortest clip ``forward`` accepts: every rollout pass needs one position left to score."""
        return self.config.min_frames

    @property
    def param_dtype(self) -> torch.dtype:
        """The transformers' weight dtype: float32, or bf16/fp16 where a precision plugin cast the weights
        (DeepSpeed's bf16, ``bf16-true``); the quantizers' codebooks stay float32 either way."""
        return self.mask_token.dtype

    # ----------------------------------------------------------------------------------------------
    # Pieces
    # ----------------------------------------------------------------------------------------------
    def check_frames(self, x: Tensor, name: str = "x", min_frames: int = 1) -> None:
        C, H, W = self.config.in_channels, self.config.height, self.config.width
        if x.ndim != 5 or tuple(x.shape[2:]) != (C, H, W):
            raise ValueError(f"{name}: expected shape [B, T, {C}, {H}, {W}], got {tuple(x.shape)}")
        if x.shape[1] < min_frames:
            raise ValueError(f"{name}: needs at least {min_frames} frames, got T={x.shape[1]}")

    def tokenize(self, x: Tensor) -> Tensor:
        """Frames ``[B, T, C, H, W]`` -> tokens ``[B, T, N, D]`` (no positional embedding). Frames are cast to
        half-precision weights (DeepSpeed's bf16, ``bf16-true``)."""
        B = x.shape[0]
        return to_sequence(self.tokenizer(to_weight_dtype(x.flatten(0, 1), self.param_dtype)), B)

    def detokenize(self, tokens: Tensor) -> Tensor:
        """Tokens ``[B, T, N, D]`` -> frames ``[B, T, C, H, W]``."""
        B = tokens.shape[0]
        return self.detokenizer(to_maps(tokens, *self.grid)).unflatten(0, (B, -1))

    def action_tokens(self, x: Tensor, t0: int | Tensor = 0, z: Tensor | None = None) -> Tensor:
        """What the action encoder reads of frames ``x [B, T, C, H, W]``: ``[B, T, N, D]`` with the PE of frames
        ``t0..``; ``z``: the shared tokenizer's tokens of ``x`` where already computed (``action_input`` "tokens")."""
        c = self.config
        if c.action_input == "tokens":
            tokens = self.tokenize(x) if z is None else z
        else:
            # frame t beside its change to frame t+1 (0 after the last)
            x = torch.cat([x, torch.cat([x[:, 1:] - x[:, :-1], torch.zeros_like(x[:, :1])], dim=1)], dim=2)
            B = x.shape[0]
            tokens = to_sequence(self.action_tokenizer(to_weight_dtype(x.flatten(0, 1), self.param_dtype)), B)
        return tokens + self.pos_embedding(x.shape[1], t0, spatial=c.action_spatial_pe)

    def next_frames(self, out: Tensor, fed: Tensor) -> Tensor:
        """The predictor's output tokens ``[B, t, N, D]`` at frames ``fed [B, t, C, H, W]`` -> the predicted next frames
        ``[B, t, C, H, W]``: the detokenized output, added to ``fed`` when the model is ``residual``."""
        pred = self.detokenize(out)
        return fed + pred if self.config.residual else pred

    def pos_embedding(self, length: int, t0: int | Tensor = 0, spatial: bool = True) -> Tensor:
        """Spatial + temporal PE for frames ``t0..t0+length-1``: ``[length, N, D]`` or ``[B, length, N, D]``
        (without ``spatial``: the temporal PE alone, ``[(B,) length, 1, D]``)."""
        temporal = temporal_pos_embedding(length, self.config.d_model, t0, self.spatial_pe.device)[..., :, None, :]
        return (temporal + self.spatial_pe if spatial else temporal).to(self.param_dtype)

    def sample_time_offset(self, batch: int, device: torch.device, generator: torch.Generator | None = None) -> Tensor:
        """The requirement's random temporal-PE start, one per sample: ``[B]`` ints in [0, max_time_offset]."""
        return torch.randint(0, self.config.max_time_offset + 1, (batch,), device=device, generator=generator)

    @staticmethod
    def random_roll(x: Tensor, most: int, generator: torch.Generator | None = None) -> Tensor:
        """Each clip of ``x [B, T, C, H, W]`` rolled (wrapping) by its own random shift of 0..``most`` cells along H
        and along W, the same for all its frames."""
        B, _, _, H, W = x.shape
        shifts = torch.randint(0, most + 1, (2, B, 1), device=x.device, generator=generator)
        rows = (torch.arange(H, device=x.device) - shifts[0]) % H  # [B, H]: row h of the output is row rows[b, h]
        cols = (torch.arange(W, device=x.device) - shifts[1]) % W
        x = x.gather(3, rows[:, None, None, :, None].expand_as(x))
        return x.gather(4, cols[:, None, None, None, :].expand_as(x))

    def sample_token_mask(self, B: int, T: int, device: torch.device, generator: torch.Generator | None = None) -> Tensor | None:
        """Bernoulli(mask_prob) token mask ``[B, T, N]`` in training, None otherwise."""
        if not self.training or self.config.mask_prob == 0.0:
            return None
        N = self.grid[0] * self.grid[1]
        return torch.rand(B, T, N, device=device, generator=generator) < self.config.mask_prob

    def apply_token_mask(self, tokens: Tensor, mask: Tensor | None) -> Tensor:
        if mask is None:
            return tokens
        return torch.where(mask[..., None], self.mask_token.to(tokens.dtype), tokens)

    # ----------------------------------------------------------------------------------------------
    # Public API
    # ----------------------------------------------------------------------------------------------
    # Frames through the action encoder at once when a long clip is read window by window (each window re-reads its
    # frames): bounds the activations of a 256-step rollout's actions, with batches large enough to keep a GPU busy.
    ACTION_CHUNK_FRAMES: ClassVar[int] = 512

    def encode_actions(self, x: Tensor, t0: int = 0, window: int | None = None) -> RVQOutput:
        """Latent actions of a clip ``[B, T, C, H, W]``: quantized ``[B, T-1, Da]``, indices ``[B, T-1, La]``.

        ``window``: the most frames the action encoder sees at once (its training window; None: the whole clip).
        A longer clip is read as generation plays it: ``a_i`` from frames ``max(0, i+2-window)..i+1`` at their own
        temporal positions ``t0 + frame``. The first window gives ``a_0..a_{window-2}`` (exactly what the whole
        clip gives: the encoder is causal with one frame of lookahead), each later window its last action."""
        self.check_frames(x, min_frames=2)
        B, T = x.shape[:2]
        if window is None or T <= window:
            return self.action_encoder(self.action_tokens(x, t0))
        if window < 2:
            raise ValueError(f"window must be >= 2 frames (one transition), got {window}")
        z = [self.action_encoder.embed(self.action_tokens(x[:, :window], t0))]
        starts = list(range(1, T - window + 1))  # window s: frames s..s+window-1, its last action a_{s+window-2}
        per_chunk = max(1, self.ACTION_CHUNK_FRAMES // (B * window))
        for i in range(0, len(starts), per_chunk):
            chunk = starts[i : i + per_chunk]
            clips = torch.stack([x[:, s : s + window] for s in chunk], dim=1).flatten(0, 1)  # [B*n, window, C, H, W]
            offsets = torch.arange(chunk[0], chunk[-1] + 1, device=x.device).repeat(B) + t0  # [B*n], sample-major
            last = self.action_encoder.embed(self.action_tokens(clips, offsets))[:, -1]
            z.append(last.reshape(B, len(chunk), -1))
        return self.action_encoder.rvq(torch.cat(z, dim=1))  # [B, T-1, Da]: eval, no step: no codebook update

    def encode_world(self, x: Tensor, t0: int | Tensor = 0) -> RVQOutput:
        """World hypothesis of a clip: quantized ``[B, Dh]``, indices ``[B, Lh]``."""
        self.check_frames(x)
        x = x[:, : self.config.world_frames]
        return self.world_encoder(self.tokenize(x) + self.pos_embedding(x.shape[1], t0))

    def action_attention(self, x: Tensor, t0: int | Tensor = 0) -> list[Tensor]:
        """Temporal attention weights of each action-encoder block, ``[B, heads, T, T]`` averaged over patches."""
        self.check_frames(x, min_frames=2)
        return self.action_encoder.attention(self.action_tokens(x, t0))

    def predict(self, context: Tensor, actions: Tensor, world: Tensor, t0: int | Tensor = 0) -> Tensor:
        """One-step predictions ``[B, t, C, H, W]``: output ``i`` predicts frame ``i+1`` from
        ``context[:, :i+1]``, ``actions[:, :i+1]`` (``[B, t, Da]``) and ``world`` (``[B, Dh]``)."""
        self.check_frames(context, "context")
        B, t = context.shape[:2]
        self.check_codes(actions, world, B, t, f"t={t}")
        tokens = self.tokenize(context) + self.pos_embedding(t, t0)
        return self.next_frames(self.dynamics(tokens, actions, world)[0], context)

    def check_codes(self, actions: Tensor, world: Tensor, B: int, transitions: int, what: str,
                    at_least: bool = False) -> None:
        """Raise ``ValueError`` unless ``actions`` is ``[B, transitions (or more, at_least), Da]`` and ``world``
        ``[B, Dh]`` (a ``[Dh]`` world would broadcast into extra frames rather than fail). ``what``: the length the
        message asks for."""
        c = self.config
        T = actions.shape[1] if actions.ndim == 3 else -1
        if (actions.ndim != 3 or actions.shape[0] != B or actions.shape[2] != c.d_code_action
                or (T < transitions if at_least else T != transitions)):
            raise ValueError(f"actions: expected [B={B}, {what}, Da={c.d_code_action}], got {tuple(actions.shape)}")
        if world.shape != (B, c.d_code_world):
            raise ValueError(f"world: expected [B={B}, Dh={c.d_code_world}], got {tuple(world.shape)}")

    @torch.no_grad()
    def generate(
        self, context: Tensor, actions: Tensor, world: Tensor, steps: int, t0: int = 0,
        window: int | None = None, use_cache: bool = True,
    ) -> Tensor:
        """Play the world forward: the ``steps`` frames after ``context [B, c, C, H, W]`` -> ``[B, steps, C, H, W]``.

        Frame ``j`` is predicted from the frames before it (the context, then the model's own predictions,
        re-tokenized as in the rollout training), actions ``a_0..a_{j-1}`` (``actions [B, >= c + steps - 1, Da]``,
        ``a_i`` for the transition ``i -> i + 1``) and the world code ``world [B, Dh]``; frame ``i`` sits at
        temporal position ``t0 + i``. Each frame attends to the last ``window`` frames in every block (None: all of them):
        rollouts longer than the trained window slide it and keep counting positions. As in any sliding-window
        cache, a frame's keys in deeper blocks were computed over its own window, so what reaches a new frame
        spans up to ``depth * (window - 1) + 1`` frames. With ``use_cache`` the
        predictor keeps its temporal keys/values, so each frame costs one frame of compute; without, every
        frame recomputes the whole (windowed) context: the same numbers, the reference.
        """
        self.check_frames(context, "context")
        B, c = context.shape[:2]
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        self.check_codes(actions, world, B, c + steps - 1,
                         f">= {c + steps - 1} (for {c} context frames and {steps} steps)", at_least=True)
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        frames = list(context.unbind(dim=1))  # [B, C, H, W] each: the context, then the generated frames
        cache = None
        for i in range(c + steps - 1):  # feed frame i, read the prediction of frame i + 1
            if use_cache:
                nxt, cache = self.step(frames[i], actions[:, i], world, cache, t0 + i, window)
            else:
                tokens = self.tokenize(torch.stack(frames[: i + 1], dim=1)) + self.pos_embedding(i + 1, t0)  # all again
                out = self.dynamics(tokens, actions[:, : i + 1], world, window)[0][:, -1:]
                nxt = self.next_frames(out, frames[i][:, None])[:, 0]
            if i >= c - 1:
                frames.append(nxt)
        return torch.stack(frames[c:], dim=1)

    @torch.no_grad()
    def step(
        self, frame: Tensor, action: Tensor, world: Tensor, cache: list[KV] | None, t: int, window: int | None = None,
    ) -> tuple[Tensor, list[KV]]:
        """One frame of a KV-cached rollout: ``frame [B, C, H, W]`` at temporal position ``t``, the action ``[B, Da]``
        taken after it and ``world [B, Dh]`` -> (the next frame ``[B, C, H, W]``, the updated cache). A rollout starts
        with ``cache=None`` at its first frame; :meth:`generate` is this in a loop."""
        token = self.tokenize(frame[:, None]) + self.pos_embedding(1, t)  # [B, 1, N, D]
        out, cache = self.dynamics.step(token, action[:, None], world, cache, window)
        return self.next_frames(out, frame[:, None])[:, 0], cache

    def world_phase_at(self, step: int | None) -> str:
        """What the predictor gets for the world at global ``step`` under ``world_curriculum`` (a pure function of
        the step): ``"off"`` (nothing: the world token is left out), ``"unquantized"`` (the world encoder's output
        itself), ``"quantized"`` (its code, the requirement's; always for ``step=None``)."""
        off = int(self.config.world_curriculum[0])
        if step is None or step >= self.quantized_world_from:
            return "quantized"
        return "off" if step < off else "unquantized"

    @property
    def quantized_world_from(self) -> int:
        """The first global step at which the predictor trains with the world code (``world_curriculum``'s sum)."""
        return sum(int(n) for n in self.config.world_curriculum)

    def world_phase_of_weights(self, global_step: int) -> str:
        """The :meth:`world_phase_at` the weights of ``global_step`` (a checkpoint's: optimizer steps done) last
        trained in: what evaluating or playing them feeds the predictor."""
        return self.world_phase_at(max(global_step - 1, 0))

    @staticmethod
    def world_input(world: RVQOutput, phase: str) -> Tensor:
        """The world vector the predictor gets in a :meth:`world_phase_at`: the code (straight-through to the encoder),
        the encoder's output (the same gradient path, the code's value taken out), or zeros."""
        if phase == "quantized":
            return world.quantized
        if phase == "unquantized":  # value z_e, gradient as through the straight-through code
            return world.quantized - (world.quantized - world.inputs).detach()
        if phase == "off":
            return torch.zeros_like(world.quantized)
        raise ValueError(f"world phase must be off, unquantized or quantized, got {phase!r}")

    @torch.no_grad()
    def infer_codes(self, clip: Tensor, world_phase: str = "quantized") -> tuple[Tensor, Tensor]:
        """What a clip ``[B, T, C, H, W]`` gives the predictor to play it: its action codes ``[B, T-1, Da]`` and its
        world vector ``[B, Dh]`` as the :meth:`world_phase_at` ``world_phase`` feeds it (the code: ``"quantized"``)."""
        return self.encode_actions(clip).quantized, self.world_input(self.encode_world(clip), world_phase)

    def forward(self, x: Tensor, step: int | Tensor, t0: int | Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """Training/validation loss of a batch ``x [B, T, C, H, W]`` at global ``step`` -> ``(loss, logs)``: the
        loss and logs of :meth:`compute` at its defaults (the predictor gets the world code; the training step
        calls :meth:`compute` itself, for the codes and predictions the callbacks read)."""
        out = self.compute(x, step, t0)
        return out.loss, out.logs

    def compute(
        self, x: Tensor, step: int | Tensor | None, t0: int | Tensor | None = None,
        generator: torch.Generator | None = None, reuse_prefix: bool = True, world_phase: str = "quantized",
        labels: Tensor | None = None,
    ) -> WorldModelOutput:
        """Everything ``forward`` computes, with the codes and per-pass predictions kept for callbacks.

        In training mode (and with a ``step``) the quantizers' EMA codebooks are updated, tokens are masked
        and ``t0=None`` draws a random temporal-PE start per sample; in eval mode ``t0=None`` means 0.
        ``generator`` (on ``x``'s device) draws the token mask and the PE start; None: the global RNG.
        ``reuse_prefix=False`` recomputes the positions of each rollout pass that equal the previous pass's
        (the same loss and gradients, more compute: the reference the tests compare against). ``world_phase``:
        what the predictor gets for the world (:meth:`world_phase_at`; the encoder, its quantizer and commitment loss
        run in every phase, so the codebook follows the encoder before the predictor ever sees a code). ``labels``:
        the true actions ``[B, T]`` (-1: unknown) the label head (``action_labels``) learns from.
        """
        self.check_frames(x, min_frames=self.min_frames)
        B, T = x.shape[:2]
        if t0 is None:
            t0 = self.sample_time_offset(B, x.device, generator) if self.training else 0

        z_raw = self.tokenize(x)  # [B, T, N, D], the one tokenizer pass over the ground truth as it is
        pe = self.pos_embedding(T, t0)  # [(B,) T, N, D]
        if self.training and self.config.action_shift > 0:
            action_tokens = self.action_tokens(self.random_roll(x, self.config.action_shift, generator), t0)
        else:
            action_tokens = self.action_tokens(x, t0, z_raw)
        actions = self.action_encoder(action_tokens, step)  # unmasked: [B, T-1, Da]
        mask = self.sample_token_mask(B, T, x.device, generator)  # [B, T, N] or None
        unplaced = self.apply_token_mask(z_raw, mask)  # [B, T, N, D], before the PE
        z_masked = unplaced + pe
        world = self.world_encoder(z_masked[:, : self.config.world_frames], step)  # [B, Dh]
        world_in = self.world_input(world, world_phase)  # [B, Dh]: the code, unless a warm-up phase

        dropout = self.config.context_dropout
        alone = self.training and dropout > 0 and bool(
            torch.rand((), device=x.device, generator=generator) < dropout)
        predictions, pass_losses = self._rollout_passes(x, z_raw, z_masked, mask, pe, actions.quantized, world_in,
                                                        reuse_prefix, window=1 if alone else None)
        prediction_loss = sum(w * l for w, l in zip(self.config.rollout_weights, pass_losses))
        weight_action, weight_world = self.commitment_weights(T)
        # the commitment losses train their encoder and, through it, the shared tokenizer (docs/model.md,
        # Model conventions)
        loss = prediction_loss + weight_action * actions.commit_loss + weight_world * world.commit_loss
        contrast = []
        if self.config.world_contrast > 0:
            contrast = [self.world_contrast_loss(unplaced.detach())]
            loss = loss + self.config.world_contrast * contrast[0]

        supervised = []
        if self.config.action_labels:
            supervised = self.label_loss(actions.quantized, labels, B, T)
            loss = loss + self.config.label_weight * supervised[0]

        values = [loss, prediction_loss, *pass_losses, actions.commit_loss, actions.codebook_loss, world.commit_loss,
                  world.codebook_loss, *contrast, *supervised]  # in the order of log_keys
        logs = {key: value.detach() for key, value in zip(self.log_keys, values, strict=True)}
        return WorldModelOutput(loss, logs, actions, world, predictions, mask)

    def label_loss(self, vectors: Tensor, labels: Tensor | None, B: int, T: int) -> list[Tensor]:
        """The label head's cross-entropy and accuracy over the labelled transitions (``labels [B, T]``, -1: none;
        ``a_i`` is the action after frame ``i``) from the action codes ``[B, T-1, Da]`` (straight-through to the encoder:
        the codes themselves are to name the actions); 0 where none is labelled."""
        y = torch.full((B, T - 1), -1, device=vectors.device) if labels is None else labels[:, : T - 1]
        logits = self.label_head(vectors.float())  # [B, T-1, K]
        known = (y >= 0).sum()
        ce = nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-1, reduction="sum")
        correct = ((logits.argmax(-1) == y) & (y >= 0)).sum()
        return [ce / known.clamp_min(1), correct / known.clamp_min(1)]

    def world_contrast_loss(self, tokens: Tensor, temperature: float = 0.1) -> Tensor:
        """InfoNCE of the world vectors of each clip's first and last ``k`` frames (``tokens [B, T, N, D]`` without
        the PE; ``k``: the world encoder's frames, at most half the clip): each first-frames vector must pick its own
        clip's last-frames vector among the batch's, by cosine similarity / ``temperature``; both directions
        averaged. Both views sit at temporal positions 0..k-1 in every clip: a clip's own PE offset would tell it
        apart from the others without its world."""
        B, T = tokens.shape[:2]
        k = min(self.config.world_frames or T, T // 2)
        pe = self.pos_embedding(k, 0)  # [k, N, D]
        first = nn.functional.normalize(self.world_encoder.embed(tokens[:, :k] + pe), dim=-1)  # [B, Dh]
        last = nn.functional.normalize(self.world_encoder.embed(tokens[:, T - k :] + pe), dim=-1)
        logits = first @ last.T / temperature  # [B, B]: clip i's first frames against clip j's last
        labels = torch.arange(B, device=tokens.device)
        return (nn.functional.cross_entropy(logits, labels) + nn.functional.cross_entropy(logits.T, labels)) / 2

    def _rollout_passes(
        self, x: Tensor, z_raw: Tensor, z_masked: Tensor, mask: Tensor | None, pe: Tensor, actions: Tensor,
        world: Tensor, reuse_prefix: bool, window: int | None = None,
    ) -> tuple[list[Tensor], list[Tensor]]:
        """The teacher-forcing pass and the rollout passes of :meth:`compute` -> per pass its predictions
        ``[B, T-1, C, H, W]`` of frames 1..T-1 and its loss (the MSE over the positions it scores).

        Position p (0..T-2) of every pass predicts frame p+1. Pass 0 (teacher forcing) feeds frames 0..T-2
        (``z_masked``: tokens masked, PE added); pass k >= 1 feeds frame 0 at position 0 and pass k-1's prediction of
        frame p at position p >= 1, and scores positions k..T-2. By the requirement's proof its first k positions get
        the same inputs as pass k-1's, so (causal predictor) the same outputs and temporal keys/values: pass k
        computes positions k..T-2 only, after pass k-1's keys/values of positions 0..k-1. ``reuse_prefix=False``
        recomputes every position. ``window``: the frames each position's predictor attends to (None: all before it)."""
        target = x[:, 1:]  # frames 1..T-1
        predictions: list[Tensor] = []
        pass_losses: list[Tensor] = []
        past = None
        passes = len(self.config.rollout_weights)
        for k in range(passes):
            first = k if reuse_prefix else 0  # the first position this pass computes
            if k == 0:
                inputs, fed = z_masked[:, :-1], x[:, :-1]  # frames 0..T-2
            else:
                inputs, fed = self._rollout_inputs(x, predictions[-1], first, z_raw, mask, pe)
            out, cache = self.dynamics(inputs, actions[:, first:], world, window=window, past=past)
            pred = self.next_frames(out, fed)  # [B, T-1-first, C, H, W]: predictions of frames first+1..T-1
            if first:  # positions 0..first-1: pass k-1's (the same, by the proof)
                pred = torch.cat([predictions[-1][:, :first], pred], dim=1)
            predictions.append(pred)
            error = (pred[:, k:].float() - target[:, k:].float()).pow(2)  # positions k..T-2
            pass_losses.append(error.mean())
            if reuse_prefix and k + 1 < passes:
                past = _kv_prefix(cache, k + 1)
        return predictions, pass_losses

    def _rollout_inputs(self, x: Tensor, previous: Tensor, first: int, z_raw: Tensor, mask: Tensor | None,
                        pe: Tensor) -> tuple[Tensor, Tensor]:
        """A rollout pass's inputs at positions ``first..T-2``: the tokens ``[B, T-1-first, N, D]`` and the frames they
        are made of ``[B, T-1-first, C, H, W]``: frame 0 of ``x`` at position 0 (where ``first`` is 0), then
        ``previous`` (the pass before's predictions ``[B, T-1, C, H, W]`` of frames 1..T-1), the frame predicted for
        position p fed at position p; re-tokenized, masked as teacher forcing, PE added."""
        positions = previous.shape[1]  # T-1
        frames = previous[:, max(first - 1, 0) : positions - 1]  # predictions of frames max(first, 1)..T-2
        tokens = self.tokenize(frames)
        if first == 0:
            tokens = torch.cat([z_raw[:, :1], tokens], dim=1)
            frames = torch.cat([x[:, :1].to(frames.dtype), frames], dim=1)
        tokens = self.apply_token_mask(tokens, None if mask is None else mask[:, first:positions])
        return tokens + pe[..., first:positions, :, :], frames

    def commitment_weights(self, T: int) -> tuple[float, float]:
        """The weights of the two commitment losses next to the per-element prediction MSE, for clips of ``T``.

        The requirement's loss is a sum: ``sum_t ||tau_hat_{t+1} - tau_{t+1}||^2 + beta_a sum_i ||z_i - sg[e_i]||^2
        + beta_h ||z_h - sg[e_h]||^2``, each squared norm over a whole frame (``C*H*W`` values), an action vector
        (``Da``) or the world vector (``Dh``). Divided by the ``(T-1)*C*H*W`` predicted values, so that the
        prediction terms read as per-element MSEs, it weighs the per-element commitment MSEs by
        ``beta_a * Da / (C*H*W)`` (one action per predicted frame) and ``beta_h * Dh / ((T-1)*C*H*W)`` (one
        world vector per clip). A per-element commitment weighted by ``beta`` itself would be ``C*H*W / Da``
        times (2048x at the defaults) stronger than the requirement's; on the synthetic world it pinned every
        action vector to one code and the actions were never learned."""
        c = self.config
        elements = c.in_channels * c.height * c.width
        return c.beta_action * c.d_code_action / elements, c.beta_world * c.d_code_world / (max(T - 1, 1) * elements)

    @property
    def log_keys(self) -> list[str]:
        """The keys of ``compute(...).logs``, in order."""
        rollouts = [f"Dynamics_Predictor/rollout_{k}_loss" for k in range(1, len(self.config.rollout_weights))]
        return [
            "Total/loss", "Dynamics_Predictor/prediction_loss", "Dynamics_Predictor/tf_loss", *rollouts,
            "Action_Encoder/commit_loss", "Action_Encoder/codebook_loss",
            "World_Encoder/commit_loss", "World_Encoder/codebook_loss",
            *(["World_Encoder/contrast_loss"] if self.config.world_contrast > 0 else []),
            *(["Action_Encoder/label_loss", "Action_Encoder/label_accuracy"] if self.config.action_labels else []),
        ]

    @property
    def compiled_parts(self) -> dict[str, nn.Module]:
        """What :meth:`compile_parts` compiles: every module of the step but the quantizers, which stay eager
        (their EMA update writes buffers, reads the step count and under DDP runs a collective): the step's
        only graph breaks are the two quantizer calls."""
        parts = {"tokenizer": self.tokenizer, "detokenizer": self.detokenizer,
                 "action transformer": self.action_encoder.transformer,
                 "world transformer": self.world_encoder.transformer, "dynamics": self.dynamics}
        if hasattr(self, "action_tokenizer"):
            parts["action tokenizer"] = self.action_tokenizer
        return parts

    def compile_parts(self, **kwargs) -> None:
        """``torch.compile`` :attr:`compiled_parts` in place (state-dict keys unchanged)."""
        for part in self.compiled_parts.values():
            part.compile(**kwargs)

    # ----------------------------------------------------------------------------------------------
    @property
    def quantizers(self) -> dict[str, ResidualVectorQuantizer]:
        """The two quantizers by namespace (for dead-code revival and codebook metrics)."""
        return {"Action_Encoder": self.action_encoder.rvq, "World_Encoder": self.world_encoder.rvq}
