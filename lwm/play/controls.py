"""The keys of ``lwm play``: which action code tuple each key plays."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import h5py
import numpy as np
import torch

NUMBER_KEYS = 9  # keys 1..9
MAX_LABELED_FILES = 128  # labeled files read for the true-action mapping
DIRECTIONS = {"up": ("ArrowUp", "w"), "down": ("ArrowDown", "s"), "left": ("ArrowLeft", "a"), "right": ("ArrowRight", "d")}
NOOP_KEYS = (" ",)
SYNTH_ACTIONS = {0: "stay", 1: "up", 2: "down", 3: "left", 4: "right"}  # lwm.data.synth's MOVES
ALE_ACTIONS = {0: "noop", 1: "fire", 2: "up", 3: "right", 4: "left", 5: "down"}  # ALE action ids
NOOP_NAMES = ("stay", "noop")


@dataclass(frozen=True)
class Binding:
    """Keys (``KeyboardEvent.key`` values, letters lower case) that play one action tuple."""

    keys: tuple[str, ...]
    action: tuple[int, ...]  # one code per RVQ level
    label: str  # what the page shows beside the keys
    share: float  # the tuple's share of the dictionary's transitions, or of the true action's

    def to_json(self) -> dict:
        return asdict(self)


def number_keys(tuples: torch.Tensor, counts: torch.Tensor, n: int = NUMBER_KEYS) -> list[Binding]:
    """Keys ``1..n`` for the ``n`` most frequent tuples ``[U, La]`` of a code dictionary (``counts [U]``)."""
    order = torch.argsort(counts, descending=True, stable=True)[:n]
    total = float(counts.sum())
    return [Binding((str(i + 1),), tuple(int(c) for c in tuples[j]), f"code {tuple(int(c) for c in tuples[j])}",
                    float(counts[j]) / total) for i, j in enumerate(order.tolist())]


def action_names(path: str | Path) -> dict[int, str]:
    """The true actions' names where a file's maker says them (``synth`` or ``game`` attributes), else {}."""
    with h5py.File(path, "r") as f:
        if "synth" in f.attrs:
            return SYNTH_ACTIONS
        if "game" in f.attrs:
            return ALE_ACTIONS
    return {}


@torch.no_grad()
def cooccurrence(model, files: list[Path], window: int | None, device: torch.device,
                 max_files: int = MAX_LABELED_FILES) -> dict[int, Counter]:
    """For each true action of the labeled ``files`` (those with ``actions``; at most ``max_files``), how often each
    latent action tuple was inferred beside it (``window``: the training window's frames)."""
    counts: dict[int, Counter] = {}
    labeled = 0
    for path in files:
        with h5py.File(path, "r") as f:
            if "actions" not in f or labeled >= max_files:
                continue
            key = "latents" if "latents" in f else next(k for k, v in f.items() if getattr(v, "ndim", 0) == 4)
            clip = torch.from_numpy(np.asarray(f[key], dtype=np.float32))[None].to(device)  # [1, T, C, H, W]
            true = np.asarray(f["actions"][: clip.shape[1] - 1])
        labeled += 1
        if clip.shape[1] < 2:
            continue
        codes = model.encode_actions(clip, window=window).indices[0].cpu()  # [T-1, La]
        for a, code in zip(true.tolist(), codes.tolist()):
            counts.setdefault(int(a), Counter())[tuple(code)] += 1
    return counts


def true_action_keys(counts: dict[int, Counter], names: dict[int, str]) -> tuple[list[Binding], Binding | None]:
    """(arrow / WASD bindings, the no-op's binding or None) from :func:`cooccurrence` counts."""
    if not counts:
        return [], None
    named = {names[a]: a for a in counts if a in names}
    if any(d in named for d in DIRECTIONS):
        directions = {d: named[d] for d in DIRECTIONS if d in named}
    else:  # names unknown
        directions = dict(zip(DIRECTIONS, sorted(counts)))
    arrows = [_binding(DIRECTIONS[d], a, counts[a], names) for d, a in directions.items()]
    noop = next((named[n] for n in NOOP_NAMES if n in named), None)
    return arrows, (_binding(NOOP_KEYS, noop, counts[noop], names) if noop is not None else None)


def _binding(keys: tuple[str, ...], true: int, counter: Counter, names: dict[int, str]) -> Binding:
    """The keys of true action ``true``: its most frequent latent tuple and that tuple's share of its transitions."""
    code, n = counter.most_common(1)[0]
    name = f"true action {true}" + (f" ({names[true]})" if true in names else "")
    return Binding(keys, tuple(code), f"{name} -> code {tuple(code)}", n / sum(counter.values()))


def most_frequent_noop(number: list[Binding]) -> Binding:
    """Space for the most frequent tuple, where the data names no no-op."""
    top = number[0]
    return Binding(NOOP_KEYS, top.action, f"most frequent: code {top.action}", top.share)
