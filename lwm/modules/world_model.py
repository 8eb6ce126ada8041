"""The world model: the shared tokenizer/detokenizer, the three parts, the loss and generation (see docs/model.md)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import Tensor, nn

from lwm.modules.config import WorldModelConfig
from lwm.modules.encoders import ActionEncoder, DynamicsPredictor, WorldEncoder, to_weight_dtype
from lwm.modules.rvq import ResidualVectorQuantizer, RVQOutput
from lwm.modules.st_transformer import (
    KV,
    Attention,
    Detokenizer,
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
    """Latent world model on Video-VAE latents ``x [B, T, C, H, W]`` in [-1, 1]: ``WorldModel(config)``,
    ``WorldModel(**fields)`` or both (keywords override the config's :class:`WorldModelConfig` fields)."""

    def __init__(self, config: WorldModelConfig | None = None, **overrides) -> None:
        c = replace(config or WorldModelConfig(), **overrides)
        super().__init__()
        self.config = c
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
                                            per_transition=c.action_input == "transition",
                                            max_pool=c.action_max_pool, **rvq)
        self.world_encoder = WorldEncoder(c.d_model, c.n_heads, c.depth_world, c.d_code_world,
                                          c.codebook_sizes_world, c.mlp_ratio, st, **rvq)
        self.dynamics = DynamicsPredictor(c.d_model, c.n_heads, c.depth_dynamics, c.d_code_action, c.d_code_world,
                                          c.mlp_ratio, st)
        # frozen when unused (mask_prob 0): DDP without find_unused_parameters wants a gradient for every parameter
        self.mask_token = nn.Parameter(torch.randn(c.d_model) * 0.02, requires_grad=c.mask_prob > 0)
        self.register_buffer("spatial_pe", spatial_pos_embedding(*self.grid, c.d_model), persistent=False)  # [N, D]
        self.apply(self._init_weights)
        # The projections into and out of the small code spaces keep unit scale: at 0.02 the codes' effect on the
        # predictor's tokens starts far below the tokens, and the world code learned far slower.
        for layer in (self.action_encoder.to_code, self.world_encoder.to_code, self.dynamics.action_proj,
                      self.dynamics.world_proj):
            nn.init.normal_(layer.weight, std=layer.in_features**-0.5)
        if c.residual:
            nn.init.zeros_(self.detokenizer.net[-1].weight)
            nn.init.zeros_(self.detokenizer.net[-1].bias)
        if c.action_labels:  # made last: the other weights are those of the same model without it
            self.label_head = nn.Linear(c.d_code_action, c.action_labels)

    def checkpointing(self, on: bool) -> AbstractContextManager[None]:
        """Activation checkpointing of every ST transformer set to ``on`` inside the block."""
        transformers = (self.action_encoder.transformer, self.world_encoder.transformer, self.dynamics.transformer)
        return _setting(transformers, "checkpointing", on)

    @contextmanager
    def counting_form(self) -> Iterator[None]:
        """The same function in the form whose FLOP count is the step's useful work: no activation checkpointing
        (its recomputed forward is not useful) and SDPA attention (counted for the pairs the mask allows)."""
        with self.checkpointing(False), _setting([m for m in self.modules() if isinstance(m, Attention)], "kernel",
                                                 "sdpa"):
            yield

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    @property
    def param_dtype(self) -> torch.dtype:
        """The transformers' weight dtype (bf16/fp16 where a precision plugin cast them; codebooks stay fp32)."""
        return self.mask_token.dtype

    def check_frames(self, x: Tensor, name: str = "x", min_frames: int = 1) -> None:
        C, H, W = self.config.in_channels, self.config.height, self.config.width
        if x.ndim != 5 or tuple(x.shape[2:]) != (C, H, W):
            raise ValueError(f"{name}: expected shape [B, T, {C}, {H}, {W}], got {tuple(x.shape)}")
        if x.shape[1] < min_frames:
            raise ValueError(f"{name}: needs at least {min_frames} frames, got T={x.shape[1]}")

    def tokenize(self, x: Tensor, tokenizer: nn.Module | None = None) -> Tensor:
        """Frames ``[B, T, C, H, W]`` -> tokens ``[B, T, N, D]`` (no PE), cast to half-precision weights."""
        tokenizer = self.tokenizer if tokenizer is None else tokenizer
        return to_sequence(tokenizer(to_weight_dtype(x.flatten(0, 1), self.param_dtype)), x.shape[0])

    def detokenize(self, tokens: Tensor) -> Tensor:
        """Tokens ``[B, T, N, D]`` -> frames ``[B, T, C, H, W]``."""
        return self.detokenizer(to_maps(tokens, *self.grid)).unflatten(0, (tokens.shape[0], -1))

    def action_tokens(self, x: Tensor, t0: int | Tensor = 0, z: Tensor | None = None) -> Tensor:
        """What the action encoder reads of frames ``x``: ``[B, T, N, D]`` with the PE of frames ``t0..``; ``z``: the
        shared tokenizer's tokens of ``x`` where already computed."""
        c = self.config
        if c.action_input == "tokens":
            tokens = self.tokenize(x) if z is None else z
        else:  # frame t beside its change to frame t+1 (0 after the last)
            x = torch.cat([x, torch.cat([x[:, 1:] - x[:, :-1], torch.zeros_like(x[:, :1])], dim=1)], dim=2)
            tokens = self.tokenize(x, self.action_tokenizer)
        return tokens + self.pos_embedding(x.shape[1], t0, spatial=c.action_spatial_pe)

    def next_frames(self, out: Tensor, fed: Tensor) -> Tensor:
        """The predictor's output tokens at frames ``fed [B, t, C, H, W]`` -> the predicted next frames."""
        pred = self.detokenize(out)
        return fed + pred if self.config.residual else pred

    def pos_embedding(self, length: int, t0: int | Tensor = 0, spatial: bool = True) -> Tensor:
        """Spatial + temporal PE of frames ``t0..t0+length-1``: ``[(B,) length, N, D]`` (the temporal alone without
        ``spatial``: ``[(B,) length, 1, D]``)."""
        temporal = temporal_pos_embedding(length, self.config.d_model, t0, self.spatial_pe.device)[..., :, None, :]
        return (temporal + self.spatial_pe if spatial else temporal).to(self.param_dtype)

    def sample_time_offset(self, batch: int, device: torch.device, generator: torch.Generator | None = None) -> Tensor:
        """The random temporal-PE start of each sample: ``[B]`` ints in [0, max_time_offset]."""
        return torch.randint(0, self.config.max_time_offset + 1, (batch,), device=device, generator=generator)

    @staticmethod
    def random_roll(x: Tensor, most: int, generator: torch.Generator | None = None) -> Tensor:
        """Each clip of ``x [B, T, C, H, W]`` rolled (wrapping) by its own random 0..``most`` cells along H and W."""
        B, _, _, H, W = x.shape
        shifts = torch.randint(0, most + 1, (2, B, 1), device=x.device, generator=generator)
        rows = (torch.arange(H, device=x.device) - shifts[0]) % H  # [B, H]: row h of the output is row rows[b, h]
        cols = (torch.arange(W, device=x.device) - shifts[1]) % W
        x = x.gather(3, rows[:, None, None, :, None].expand_as(x))
        return x.gather(4, cols[:, None, None, None, :].expand_as(x))

    def apply_token_mask(self, tokens: Tensor, mask: Tensor | None) -> Tensor:
        return tokens if mask is None else torch.where(mask[..., None], self.mask_token.to(tokens.dtype), tokens)

    ACTION_CHUNK_FRAMES: ClassVar[int] = 512  # frames per action-encoder call when reading a clip window by window

    def encode_actions(self, x: Tensor, t0: int = 0, window: int | None = None) -> RVQOutput:
        """Latent actions of a clip ``[B, T, C, H, W]``: quantized ``[B, T-1, Da]``, indices ``[B, T-1, La]``.
        ``window`` (None: the whole clip): a longer clip is read as generation plays it, ``a_i`` from frames
        ``max(0, i+2-window)..i+1`` at their own temporal positions."""
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
        return self.action_encoder.rvq(torch.cat(z, dim=1))  # no step: no codebook update

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
        """One-step predictions ``[B, t, C, H, W]``: output ``i`` predicts frame ``i+1`` from ``context[:, :i+1]``,
        ``actions[:, :i+1]`` (``[B, t, Da]``) and ``world`` (``[B, Dh]``)."""
        self.check_frames(context, "context")
        B, t = context.shape[:2]
        self.check_codes(actions, world, B, t, f"t={t}")
        tokens = self.tokenize(context) + self.pos_embedding(t, t0)
        return self.next_frames(self.dynamics(tokens, actions, world)[0], context)

    def check_codes(self, actions: Tensor, world: Tensor, B: int, transitions: int, what: str,
                    at_least: bool = False) -> None:
        """``actions [B, transitions (or more: at_least), Da]`` and ``world [B, Dh]`` (a ``[Dh]`` would broadcast)."""
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
        """The ``steps`` frames after ``context [B, c, C, H, W]`` -> ``[B, steps, C, H, W]``, each predicted from the
        frames before it (its own predictions re-tokenized), ``actions [B, >= c + steps - 1, Da]`` and ``world``;
        frame ``i`` at temporal position ``t0 + i``. ``window``: the frames each block attends to (None: all);
        ``use_cache=False`` recomputes the whole context each frame (the same numbers, the reference)."""
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
                tokens = self.tokenize(torch.stack(frames[: i + 1], dim=1)) + self.pos_embedding(i + 1, t0)
                out = self.dynamics(tokens, actions[:, : i + 1], world, window)[0][:, -1:]
                nxt = self.next_frames(out, frames[i][:, None])[:, 0]
            if i >= c - 1:
                frames.append(nxt)
        return torch.stack(frames[c:], dim=1)

    @torch.no_grad()
    def step(
        self, frame: Tensor, action: Tensor, world: Tensor, cache: list[KV] | None, t: int, window: int | None = None,
    ) -> tuple[Tensor, list[KV]]:
        """One frame of a KV-cached rollout (``cache=None`` at the first): ``frame [B, C, H, W]`` at position ``t``,
        the action ``[B, Da]`` after it, ``world [B, Dh]`` -> (the next frame, the updated cache)."""
        token = self.tokenize(frame[:, None]) + self.pos_embedding(1, t)  # [B, 1, N, D]
        out, cache = self.dynamics.step(token, action[:, None], world, cache, window)
        return self.next_frames(out, frame[:, None])[:, 0], cache

    def world_phase_at(self, step: int | None) -> str:
        """What the predictor gets for the world at global ``step`` under ``world_curriculum``: ``"off"``,
        ``"unquantized"`` (the encoder's output) or ``"quantized"`` (the code; always for ``step=None``)."""
        if step is None or step >= self.quantized_world_from:
            return "quantized"
        return "off" if step < int(self.config.world_curriculum[0]) else "unquantized"

    @property
    def quantized_world_from(self) -> int:
        """The first global step at which the predictor trains with the world code."""
        return sum(int(n) for n in self.config.world_curriculum)

    def world_phase_of_weights(self, global_step: int) -> str:
        """The :meth:`world_phase_at` the weights of ``global_step`` (optimizer steps done) last trained in."""
        return self.world_phase_at(max(global_step - 1, 0))

    @staticmethod
    def unquantized(codes: RVQOutput) -> Tensor:
        """The encoder's vector ``z_e`` before quantization, its gradient reaching the encoder as the code's does."""
        return codes.quantized - (codes.quantized - codes.inputs).detach()

    @staticmethod
    def world_input(world: RVQOutput, phase: str) -> Tensor:
        """The world vector the predictor gets in a :meth:`world_phase_at` phase."""
        if phase == "quantized":
            return world.quantized
        if phase == "unquantized":
            return WorldModel.unquantized(world)
        return torch.zeros_like(world.quantized)  # "off"

    @torch.no_grad()
    def infer_codes(self, clip: Tensor, world_phase: str = "quantized") -> tuple[Tensor, Tensor]:
        """What a clip gives the predictor to play it: action codes ``[B, T-1, Da]`` and world vector ``[B, Dh]``."""
        return self.encode_actions(clip).quantized, self.world_input(self.encode_world(clip), world_phase)

    def forward(self, x: Tensor, step: int | Tensor, t0: int | Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """``(loss, logs)`` of :meth:`compute` at its defaults."""
        out = self.compute(x, step, t0)
        return out.loss, out.logs

    def compute(
        self, x: Tensor, step: int | Tensor | None, t0: int | Tensor | None = None,
        generator: torch.Generator | None = None, reuse_prefix: bool = True, world_phase: str = "quantized",
        labels: Tensor | None = None,
    ) -> WorldModelOutput:
        """The loss of a batch ``x [B, T, C, H, W]``, with the codes and per-pass predictions. Training (with a
        ``step``) updates the EMA codebooks; training masks tokens, and ``t0=None`` draws each sample's PE start (eval:
        0). ``generator`` draws the random choices; ``reuse_prefix=False`` recomputes what each rollout pass shares
        with the one before (the reference); ``labels [B, T]`` (-1: unknown) train the label head."""
        c = self.config
        self.check_frames(x, min_frames=c.min_frames)
        B, T = x.shape[:2]
        if t0 is None:
            t0 = self.sample_time_offset(B, x.device, generator) if self.training else 0
        z_raw = self.tokenize(x)  # [B, T, N, D]
        pe = self.pos_embedding(T, t0)  # [(B,) T, N, D]
        if self.training and c.action_shift > 0:
            action_tokens = self.action_tokens(self.random_roll(x, c.action_shift, generator), t0)
        else:
            action_tokens = self.action_tokens(x, t0, z_raw)
        actions = self.action_encoder(action_tokens, step)  # unmasked: [B, T-1, Da]
        mask = None
        if self.training and c.mask_prob != 0.0:
            mask = torch.rand(B, T, self.grid[0] * self.grid[1], device=x.device, generator=generator) < c.mask_prob
        unplaced = self.apply_token_mask(z_raw, mask)  # [B, T, N, D], before the PE
        z_masked = unplaced + pe
        world = self.world_encoder(z_masked[:, : c.world_frames], step)  # [B, Dh]
        world_in = self.world_input(world, world_phase)

        alone = self.training and c.context_dropout > 0 and bool(
            torch.rand((), device=x.device, generator=generator) < c.context_dropout)
        predictions, pass_losses = self._rollout_passes(x, z_raw, z_masked, mask, pe, actions.quantized, world_in,
                                                        reuse_prefix, window=1 if alone else None)
        prediction_loss = sum(w * l for w, l in zip(c.rollout_weights, pass_losses))
        weight_action, weight_world = self.commitment_weights(T)
        loss = prediction_loss + weight_action * actions.commit_loss + weight_world * world.commit_loss
        contrast = []
        if c.world_contrast > 0:
            contrast = [self.world_contrast_loss(unplaced.detach())]
            loss = loss + c.world_contrast * contrast[0]
        supervised = []
        if c.action_labels:
            supervised = self.label_loss(self.unquantized(actions), labels, B, T)
            loss = loss + c.label_weight * supervised[0]
        values = [loss, prediction_loss, *pass_losses, actions.commit_loss, actions.codebook_loss, world.commit_loss,
                  world.codebook_loss, *contrast, *supervised]  # in the order of log_keys
        logs = {key: value.detach() for key, value in zip(self.log_keys, values, strict=True)}
        return WorldModelOutput(loss, logs, actions, world, predictions, mask)

    def label_loss(self, vectors: Tensor, labels: Tensor | None, B: int, T: int) -> list[Tensor]:
        """The label head's cross-entropy and accuracy on the action vectors before quantization ``[B, T-1, Da]``
        over the labelled transitions (``labels [B, T]``, -1: none); 0 where none is labelled."""
        y = torch.full((B, T - 1), -1, device=vectors.device) if labels is None else labels[:, : T - 1]
        logits = self.label_head(vectors.float())  # [B, T-1, K]
        known = (y >= 0).sum()
        ce = nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-1, reduction="sum")
        correct = ((logits.argmax(-1) == y) & (y >= 0)).sum()
        return [ce / known.clamp_min(1), correct / known.clamp_min(1)]

    def world_contrast_loss(self, tokens: Tensor, temperature: float = 0.1) -> Tensor:
        """InfoNCE between the world vectors of each clip's first and last ``k`` frames (``tokens [B, T, N, D]``
        without PE), both at positions 0..k-1 so that no clip's PE offset tells it apart; both directions averaged."""
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
        """Each pass's predictions ``[B, T-1, C, H, W]`` of frames 1..T-1 and its MSE. Pass k >= 1 feeds frame 0, then
        pass k-1's predictions, and scores positions k..; its first k positions equal pass k-1's, so (with
        ``reuse_prefix``) it computes the later ones only, after pass k-1's keys/values there."""
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
            pred = self.next_frames(out, fed)  # predictions of frames first+1..T-1
            if first:
                pred = torch.cat([predictions[-1][:, :first], pred], dim=1)
            predictions.append(pred)
            pass_losses.append((pred[:, k:].float() - target[:, k:].float()).pow(2).mean())  # positions k..T-2
            if reuse_prefix and k + 1 < passes:  # the first k + 1 positions' keys/values, copied
                past = [(keys[:, :, : k + 1].clone(), values[:, :, : k + 1].clone()) for keys, values in cache]
        return predictions, pass_losses

    def _rollout_inputs(self, x: Tensor, previous: Tensor, first: int, z_raw: Tensor, mask: Tensor | None,
                        pe: Tensor) -> tuple[Tensor, Tensor]:
        """A rollout pass's tokens at positions ``first..T-2`` and the frames they are made of: frame 0 at position 0,
        then ``previous`` (the pass before's predictions), re-tokenized, masked as teacher forcing, PE added."""
        positions = previous.shape[1]  # T-1
        frames = previous[:, max(first - 1, 0) : positions - 1]  # predictions of frames max(first, 1)..T-2
        tokens = self.tokenize(frames)
        if first == 0:
            tokens = torch.cat([z_raw[:, :1], tokens], dim=1)
            frames = torch.cat([x[:, :1].to(frames.dtype), frames], dim=1)
        tokens = self.apply_token_mask(tokens, None if mask is None else mask[:, first:positions])
        return tokens + pe[..., first:positions, :, :], frames

    def commitment_weights(self, T: int) -> tuple[float, float]:
        """The commitment losses' weights next to the per-element prediction MSE: the requirement's summed loss divided
        by the ``(T-1)*C*H*W`` predicted values (docs/model.md, Loss balance)."""
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
        """Every module of the step but the quantizers, which stay eager (their EMA update writes buffers and under
        DDP runs a collective): the step's only graph breaks."""
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

    @property
    def quantizers(self) -> dict[str, ResidualVectorQuantizer]:
        """The two quantizers by namespace."""
        return {"Action_Encoder": self.action_encoder.rvq, "World_Encoder": self.world_encoder.rvq}
