"""One KV-cached rollout played a frame at a time, with undo: what ``lwm play`` steps on each key press."""

from __future__ import annotations

import torch
from torch import Tensor

RECENT = 64  # the last frames whose predictor cache is kept
KEYFRAME_EVERY = 64  # a cache kept for good every this many frames


class Rollout:
    """A rollout of ``model`` from ``start [C, H, W]`` (temporal position 0) under the world code of ``world_indices
    [Lh]``, attending to the last ``window`` frames (None: all)."""

    def __init__(self, model, start: Tensor, world_indices: Tensor, window: int | None) -> None:
        self.model, self.window = model, window
        self.world_indices = world_indices.long()  # [Lh]
        self.world = model.quantizers["World_Encoder"].decode_indices(self.world_indices[None].to(start.device))
        self.frames: list[Tensor] = [start]  # [C, H, W] each
        self.actions: list[Tensor] = []  # [La] each: the tuple played after frame i
        self._caches: dict[int, list | None] = {0: None}  # frames fed -> the predictor's cache after them

    @property
    def steps(self) -> int:
        return len(self.actions)

    @torch.no_grad()
    def step(self, action: Tensor) -> Tensor:
        """Play the tuple ``action [La]`` after the last frame: the next frame ``[C, H, W]``."""
        n = self.steps
        nxt, self._caches[n + 1] = self._feed(self.frames[n], action, self._cache(n), n)
        self.actions.append(action.long())
        self.frames.append(nxt)
        if (n + 1 - RECENT) % KEYFRAME_EVERY:  # the cache of RECENT frames ago goes, unless a keyframe's
            self._caches.pop(n + 1 - RECENT, None)
        return nxt

    @torch.no_grad()
    def previews(self, actions: Tensor) -> Tensor:
        """The next frame under each tuple of ``actions [K, La]``, ``[K, C, H, W]``, the rollout unchanged."""
        n, cache = self.steps, self._cache(self.steps)
        return torch.stack([self._feed(self.frames[n], a, cache, n)[0] for a in actions])

    def undo(self) -> bool:
        """Take back the last step (False: nothing to take back)."""
        if not self.actions:
            return False
        self._caches.pop(self.steps, None)
        self.actions.pop()
        self.frames.pop()
        return True

    def _feed(self, frame: Tensor, action: Tensor, cache: list | None, t: int) -> tuple[Tensor, list]:
        """Frame ``t`` and the action after it through the predictor: (frame ``t + 1``, the cache)."""
        code = self.model.quantizers["Action_Encoder"].decode_indices(action.long().to(frame.device)[None])  # [1, Da]
        nxt, cache = self.model.step(frame[None], code, self.world, cache, t, self.window)
        return nxt[0], cache

    def _cache(self, fed: int) -> list | None:
        """The cache after frames ``0..fed-1``: kept, or re-fed from the nearest kept one before it."""
        if fed not in self._caches:
            base = max(k for k in self._caches if k < fed)
            cache = self._caches[base]
            for i in range(base, fed):
                _, cache = self._feed(self.frames[i], self.actions[i], cache, i)
            self._caches[fed] = cache
        return self._caches[fed]

    def latents(self) -> Tensor:
        """Every frame so far, ``[1 + steps, C, H, W]``."""
        return torch.stack(self.frames)

    def action_indices(self) -> Tensor:
        """The tuples played, ``[steps, La]``."""
        La = len(self.model.config.codebook_sizes_action)
        return torch.stack(self.actions) if self.actions else torch.zeros(0, La, dtype=torch.long)
