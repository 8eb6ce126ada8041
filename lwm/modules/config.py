"""WorldModelConfig: every hyperparameter of the world model, the requirement's as defaults, and its checks."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import ClassVar

from lwm.modules.rvq import RVQ_EPS
from lwm.modules.st_transformer import ATTENTION_KERNELS, Tokenizer
from lwm.utils.errors import ConfigError


ACTION_INPUTS = ("tokens", "transition")


@dataclass(frozen=True)
class WorldModelConfig:
    """every hyperparameter of :class:`WorldModel`; the defaults are the requirement's."""

    in_channels: int = 16
    """latent channels C"""
    height: int = 64
    """latent height H (divisible by 4: the tokenizer downsamples by 4)"""
    width: int = 64
    """latent width W (divisible by 4)"""
    d_model: int = 512
    """token width D (divisible by 4 and by n_heads)"""
    n_heads: int = 8
    """attention heads in every ST transformer"""
    depth_action: int = 3
    """ST blocks of the action encoder"""
    depth_world: int = 3
    """ST blocks of the world encoder"""
    depth_dynamics: int = 3
    """ST blocks of the dynamics predictor"""
    mlp_ratio: float = 4.0
    """MLP hidden width / D"""
    tokenizer_hidden: int | None = None
    """channels inside the CNN tokenizer/detokenizer (None: max(D/2, 16))"""
    d_code_action: int = 32
    """action code width Da"""
    d_code_world: int = 64
    """world code width Dh"""
    codebook_sizes_action: tuple[int, ...] = (12, 64, 256)
    """codes per RVQ level, action quantizer"""
    codebook_sizes_world: tuple[int, ...] = (12, 24, 48, 256, 256, 256)
    """codes per RVQ level, world quantizer"""
    beta_action: float = 0.25
    """beta_a of the requirement's summed loss (per-element weight: see commitment_weights)"""
    beta_world: float = 0.25
    """beta_h of the requirement's summed loss (per-element weight: see commitment_weights)"""
    mask_prob: float = 0.1
    """bernoulli token-mask probability (world encoder + predictor inputs, training only)"""
    rollout_weights: tuple[float, ...] = (1.0, 0.8, 0.5)
    """loss weights of (TF, rollout 1, rollout 2, ...)"""
    max_time_offset: int = 256
    """training draws the temporal-PE start uniformly from [0, max_time_offset]"""
    ema_decay_start: float = 0.9
    """EMA decay of both quantizers at step 0"""
    ema_decay_end: float = 0.99
    """EMA decay from ema_decay_steps on (linear in between)"""
    ema_decay_steps: int = 5000
    """length of the EMA decay schedule, in global steps"""
    dead_code_steps: int = 100
    """a code unused for this many updates is dead (replaced by ``revive``)"""
    activation_checkpointing: bool = False
    """recompute every ST block's activations in the backward: less memory"""
    temporal_attention: str = "sdpa"
    """temporal attention kernel: sdpa | matmul (the same function; speed differs)"""
    world_curriculum: tuple[int, int] = (0, 0)
    """optional world-token warm-up (off by default): steps without the world token, then unquantized, then the code"""
    residual: bool = False
    """the predictor outputs the change from the frame it was fed (an untrained model copies the last frame)"""
    action_input: str = "tokens"
    """what the action encoder reads: "tokens" (the shared tokenizer's) or "transition" (its own tokenizer on each
    frame beside its change to the next, each transition alone: its code cannot say "as before")"""
    action_spatial_pe: bool = True
    """the action encoder's tokens get the spatial PE (without: its code cannot say where)"""
    action_max_pool: bool = False
    """the action encoder pools its tokens by max, not mean: a change in one token (a paddle) is not averaged away"""
    action_shift: int = 0
    """training rolls the action encoder's clips by a random 0..action_shift latent cells per axis (the predictor's
    are not): its code must say how things move, not where in a token"""
    world_frames: int | None = None
    """the world encoder reads a clip's first world_frames (None: all): its code then cannot carry what it predicts"""
    context_dropout: float = 0.0
    """the probability that a training step's predictor sees each frame alone: the codes must carry the transition"""
    world_contrast: float = 0.0
    """weight of an InfoNCE loss making the world vectors of a clip's first and last frames agree (0: off)"""
    action_labels: int = 0
    """true action classes a linear head reads from each action vector before quantization, trained on the labelled
    transitions (data.label_fraction; LAOM's semi-supervision; 0: off)"""
    label_weight: float = 0.1
    """the head's cross-entropy weight in the loss"""

    # the fields that decide the parameters' and buffers' shapes
    SHAPE_FIELDS: ClassVar[tuple[str, ...]] = (
        "in_channels", "height", "width", "d_model", "n_heads", "depth_action", "depth_world", "depth_dynamics",
        "mlp_ratio", "tokenizer_hidden", "d_code_action", "d_code_world", "codebook_sizes_action",
        "codebook_sizes_world", "action_labels")

    # deleted fields and their default: a checkpoint that holds them loads where it kept that default
    RETIRED: ClassVar[dict[str, object]] = {"fusion": "add", "change_weight": 0.0}

    @classmethod
    def from_dict(cls, fields: dict) -> "WorldModelConfig":
        """A checkpoint's ``net`` hyperparameters as a config (its retired fields at their defaults dropped)."""
        if changed := [f"{k}={v!r}" for k, v in fields.items() if k in cls.RETIRED and v != cls.RETIRED[k]]:
            raise ConfigError(f"model.net: {', '.join(changed)} is no longer an option of this lwm version")
        fields = {k: v for k, v in fields.items() if k not in cls.RETIRED}
        if fields.get("temporal_attention") == "triton":  # a retired kernel: the same function as sdpa
            fields["temporal_attention"] = "sdpa"
        return cls(**fields)

    @property
    def grid(self) -> tuple[int, int]:
        """The token grid ``(Hp, Wp)``: the CNN tokenizer downsamples by ``Tokenizer.DOWNSAMPLE`` (4)."""
        return self.height // Tokenizer.DOWNSAMPLE, self.width // Tokenizer.DOWNSAMPLE

    @property
    def min_frames(self) -> int:
        """The shortest training clip: every rollout pass needs one position left to score."""
        return len(self.rollout_weights) + 1

    def __post_init__(self) -> None:
        """Refuse an invalid configuration, one line per problem naming the field (``model.net.X``); warn where a code
        unused for ``dead_code_steps`` updates shrinks towards zero before it counts as dead."""
        if problems := _config_problems(self):
            raise ConfigError("\n".join(f"model.net.{p}" for p in problems))
        decay = min(self.ema_decay_start, self.ema_decay_end) if self.ema_decay_steps else self.ema_decay_end
        if decay ** self.dead_code_steps < RVQ_EPS:  # see lwm/modules/rvq.py: unused codes shrink by g^t/(g^t+eps)
            warnings.warn(f"model.net.dead_code_steps={self.dead_code_steps} at an EMA decay of {decay}: a code "
                          f"unused that long shrinks below half its length (decay^steps < eps = {RVQ_EPS}) before it "
                          f"counts as dead and is revived; unused codes drift to zero. Fewer dead_code_steps or a "
                          f"higher ema_decay_start avoid it", stacklevel=3)  # the caller of WorldModelConfig(...)


_AT_LEAST = {  # an integer field: its lowest value, and what the lowest or null means
    **dict.fromkeys(("in_channels", "depth_action", "depth_world", "depth_dynamics", "d_code_action", "d_code_world",
                     "dead_code_steps"), (1, "")),
    **dict.fromkeys(("ema_decay_steps", "action_shift", "max_time_offset"), (0, "")),
    "action_labels": (0, " (0: no label head)"), "tokenizer_hidden": (1, " (or null: max(d_model/2, 16))"),
    "world_frames": (1, " (or null: every frame)"),
}
_RANGES = {  # a float field: (what it must be, the largest value, whether that one is allowed)
    **dict.fromkeys(("beta_action", "beta_world", "world_contrast", "label_weight"), ("be >= 0", math.inf, True)),
    "context_dropout": ("lie in [0, 1]", 1.0, True),
    **dict.fromkeys(("mask_prob", "ema_decay_start", "ema_decay_end"), ("lie in [0, 1)", 1.0, False)),
}


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
    problems += [f"{name} must be >= {lowest}{note}, got {getattr(c, name)}" for name, (lowest, note) in
                 _AT_LEAST.items() if getattr(c, name) is not None and getattr(c, name) < lowest]
    for name in ("codebook_sizes_action", "codebook_sizes_world"):
        sizes = tuple(getattr(c, name))
        if not sizes or any(int(k) < 1 for k in sizes):
            problems.append(f"{name} needs at least one level and at least one code per level, got {sizes}")
    if "mlp_ratio" not in nonfinite:
        if not c.mlp_ratio > 0:
            problems.append(f"mlp_ratio must be > 0, got {c.mlp_ratio}")
        elif c.d_model >= 1 and int(c.d_model * c.mlp_ratio) < 1:  # (the MLP's hidden width)
            problems.append(f"mlp_ratio must give an MLP hidden width int(d_model * mlp_ratio) >= 1, got "
                            f"{c.mlp_ratio} (width {int(c.d_model * c.mlp_ratio)} at d_model {c.d_model})")
    for name, (what, high, closed) in _RANGES.items():
        value = getattr(c, name)
        if name not in nonfinite and not (0 <= value < high or closed and value == high):
            problems.append(f"{name} must {what}, got {value}")
    if not c.rollout_weights:
        problems.append("rollout_weights needs at least the teacher-forcing weight")
    elif "rollout_weights" not in nonfinite and (not all(w >= 0 for w in c.rollout_weights)
                                                 or not any(w > 0 for w in c.rollout_weights)):
        problems.append(f"rollout_weights must be >= 0, not all 0, got {_as_tuples(c.rollout_weights)}")
    if len(c.world_curriculum) != 2 or any(int(n) < 0 for n in c.world_curriculum):
        problems.append(f"world_curriculum must be two step counts >= 0 (without, then unquantized), got "
                        f"{tuple(c.world_curriculum)}")
    if c.action_input not in ACTION_INPUTS:
        problems.append(f"action_input must be one of {ACTION_INPUTS}, got {c.action_input!r}")
    if c.temporal_attention not in ATTENTION_KERNELS:
        problems.append(f"temporal_attention must be one of {ATTENTION_KERNELS}, got {c.temporal_attention!r}")
    return problems


def _nonfinite(value: object) -> bool:
    """Whether a float field (or a tuple field's float) is inf or nan."""
    values = value if isinstance(value, (tuple, list)) else (value,)
    return any(isinstance(v, float) and not math.isfinite(v) for v in values)


def _as_tuples(value: object) -> object:
    """A tuple field as a tuple (configs give lists), for messages."""
    return tuple(value) if isinstance(value, list) else value
