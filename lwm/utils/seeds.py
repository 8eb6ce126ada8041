"""Random streams as pure functions of a few integers (seed, rank, step, batch, ...): a resumed or re-run job
draws exactly what an uninterrupted one would, with no RNG state to save."""

from __future__ import annotations

import numpy as np
import torch


def seeded_generator(device: torch.device | str, *entropy: int) -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded from ``entropy`` through NumPy's ``SeedSequence`` (well mixed:
    nearby tuples give unrelated streams, unlike ``seed * 1000 + batch``, which collides)."""
    state = np.random.SeedSequence([int(e) for e in entropy]).generate_state(2)
    g = torch.Generator(device=device)
    g.manual_seed(int(state[0]) << 32 | int(state[1]))
    return g
