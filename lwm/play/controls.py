"""The keys of ``lwm play``: which action code tuple each key plays."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import torch

NUMBER_KEYS = 9  # keys 1..9: the dictionary's most frequent tuples
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


def key_bindings(model, dictionary, files: list[Path], window: int | None,
                 device: torch.device) -> tuple[list[Binding], list[Binding], Binding]:
    """(keys 1..9: the ``dictionary``'s most frequent tuples, arrows / WASD: those most often inferred beside the
    labeled ``files``' true actions, Space: their no-op, else the most frequent tuple)."""
    order = torch.argsort(dictionary.counts, descending=True, stable=True)[:NUMBER_KEYS].tolist()
    number = [Binding((str(i + 1),), tuple(code), f"code {tuple(code)}", float(dictionary.counts[j]) / dictionary.total)
              for i, (j, code) in enumerate(zip(order, dictionary.tuples[order].tolist()))]
    counts = cooccurrence(model, files, window, device)
    names = action_names(files) if counts else {}
    named = {names[a]: a for a in counts if a in names}
    directions = ({d: named[d] for d in DIRECTIONS if d in named} if any(d in named for d in DIRECTIONS)
                  else dict(zip(DIRECTIONS, sorted(counts))))  # names unknown
    arrows = [_binding(DIRECTIONS[d], a, counts[a], names) for d, a in directions.items()]
    noop = next((named[n] for n in NOOP_NAMES if n in named), None)
    top = number[0]
    return number, arrows, (_binding(NOOP_KEYS, noop, counts[noop], names) if noop is not None else
                            Binding(NOOP_KEYS, top.action, f"most frequent: code {top.action}", top.share))


def action_names(files: list[Path]) -> dict[int, str]:
    """The true actions' names where the first labeled file's maker says them (``synth``, ``game``), else {}."""
    for path in files:
        with h5py.File(path, "r") as f:
            if "actions" in f:
                return SYNTH_ACTIONS if "synth" in f.attrs else ALE_ACTIONS if "game" in f.attrs else {}
    return {}


@torch.no_grad()
def cooccurrence(model, files: list[Path], window: int | None, device: torch.device,
                 max_files: int = MAX_LABELED_FILES) -> dict[int, Counter]:
    """For each true action of the labeled ``files`` (the first ``max_files``), how often each latent action tuple
    was inferred beside it (``window``: the training window's frames)."""
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
        if clip.shape[1] >= 2:
            codes = model.encode_actions(clip, window=window).indices[0].cpu()  # [T-1, La]
            for a, code in zip(true.tolist(), codes.tolist()):
                counts.setdefault(int(a), Counter())[tuple(code)] += 1
    return counts


def _binding(keys: tuple[str, ...], true: int, counter: Counter, names: dict[int, str]) -> Binding:
    """The keys of true action ``true``: its most frequent latent tuple and that tuple's share of its transitions."""
    code, n = counter.most_common(1)[0]
    name = f"true action {true}" + (f" ({names[true]})" if true in names else "")
    return Binding(keys, tuple(code), f"{name} -> code {tuple(code)}", n / sum(counter.values()))
