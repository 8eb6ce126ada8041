"""Code dictionaries: which code tuples (one index per RVQ level) the trained encoders use, and how often."""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from lwm.data.windows import nonfinite_windows
from lwm.training.checkpoint import atomic_save
from lwm.utils.errors import DataError, torch_load_failure
from lwm.utils.video import check_output

SAMPLING = ("frequency", "uniform")  # how CodeDictionary.sample draws
STATE_KEYS = {"tuples", "counts", "codebook_sizes"}  # a dictionary's entry in the file


@dataclass
class CodeDictionary:
    """Counts of code tuples ``[L]`` of one quantizer with ``codebook_sizes``."""

    codebook_sizes: tuple[int, ...]
    tuples: Tensor = None  # [U, L] int64, unique, sorted
    counts: Tensor = None  # [U] int64

    def __post_init__(self) -> None:
        if self.tuples is None:
            self.tuples = torch.zeros(0, len(self.codebook_sizes), dtype=torch.long)
            self.counts = torch.zeros(0, dtype=torch.long)

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def update(self, indices: Tensor, counts: Tensor | None = None) -> None:
        """Count the tuples of ``indices [..., L]`` (``counts`` times each; on any device, kept on the CPU)."""
        tuples = indices.reshape(-1, len(self.codebook_sizes)).long().cpu()
        counts = torch.ones(tuples.shape[0], dtype=torch.long) if counts is None else counts
        self.tuples, inverse = torch.unique(torch.cat([self.tuples, tuples]), dim=0, return_inverse=True)
        self.counts = torch.zeros(self.tuples.shape[0], dtype=torch.long).index_add_(
            0, inverse, torch.cat([self.counts, counts]))

    def merge(self, other: CodeDictionary) -> None:
        """Add another dictionary's counts (e.g. another rank's, of the same quantizer)."""
        self.update(other.tuples, other.counts)

    def sample(self, shape: tuple[int, ...], by: str = "frequency", generator: torch.Generator | None = None) -> Tensor:
        """Tuples ``[*shape, L]`` drawn by ``frequency`` or ``uniform``-ly over the used tuples, in row-major order."""
        weights = self.counts.double() if by == "frequency" else torch.ones(self.tuples.shape[0], dtype=torch.double)
        cdf = weights.cumsum(0)
        u = torch.rand(math.prod(shape), dtype=torch.double, generator=generator) * cdf[-1]
        picks = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.numel() - 1)
        return self.tuples[picks].reshape(*shape, len(self.codebook_sizes))

    def to_state(self) -> dict[str, Tensor]:
        return {"tuples": self.tuples, "counts": self.counts,
                "codebook_sizes": torch.tensor(self.codebook_sizes, dtype=torch.long)}

    @classmethod
    def from_state(cls, state: dict[str, Tensor]) -> CodeDictionary:
        return cls(tuple(int(k) for k in state["codebook_sizes"]), state["tuples"].long(), state["counts"].long())


def save_dictionaries(path: str | Path, dictionaries: dict[str, CodeDictionary], windows: int,
                      global_step: int | None = None) -> Path:
    """Write ``codes.pt`` atomically; ``global_step``: the encoders' checkpoint step."""
    check_output(path, "the code dictionary")  # a folder in the way
    meta = {"windows": windows, **({"global_step": int(global_step)} if global_step is not None else {})}
    return atomic_save({**{k: d.to_state() for k, d in dictionaries.items()}, **meta}, path)


def check_out(path: str | Path) -> Path:
    """Refuse ``lwm codes --out`` before any encoding: a checkpoint's name, or a file that is not a code dictionary."""
    path = check_output(path, "--out")
    if path.suffix == ".ckpt" or (path.exists() and not is_dictionary_file(path)):
        raise DataError(f"--out {path}: " + ("a .ckpt name is a checkpoint's; name the code dictionary e.g. codes.pt"
                                             if path.suffix == ".ckpt" else "exists and is not a code dictionary, "
                                             "refusing to replace it (remove it or choose another --out)"))
    return path


def is_dictionary_file(path: str | Path) -> bool:
    """Whether ``path`` holds what :func:`save_dictionaries` writes (memory-mapped: a checkpoint is not read in)."""
    try:
        dictionaries, meta = _load(path, mmap=True)
    except Exception:  # JSON, h5, a checkpoint, a torn file: not one of ours
        return False
    return bool(dictionaries) and isinstance(meta.get("windows"), int)


def default_codes_path(ckpt_path: str | Path) -> Path:
    """Where a checkpoint's code dictionaries go."""
    ckpt_path = Path(ckpt_path)
    return ckpt_path.parent / ("codes.pt" if ckpt_path.name == "last.ckpt" else f"{ckpt_path.stem}.codes.pt")


def load_dictionaries(path: str | Path) -> dict[str, CodeDictionary]:
    return _load(path)[0]


def dictionaries_step(path: str | Path) -> int | None:  # the step of the encoders that made them (None: unrecorded)
    return _load(path)[1].get("global_step")


def dictionaries_for(ckpt_path: Path, codes: str | None, global_step: int | None, model,
                     names: tuple[str, ...] = ("Action_Encoder", "World_Encoder")) -> dict[str, CodeDictionary]:
    """The dictionaries ``names`` of ``model`` (checkpoint ``ckpt_path``): ``codes``, else its own beside it, else the
    end of fit's ``codes.pt``; each must be there, non-empty and of the model's codebook sizes."""
    path = Path(codes) if codes else default_codes_path(ckpt_path)
    if not codes and not path.is_file() and (ckpt_path.parent / "codes.pt").is_file():
        path = ckpt_path.parent / "codes.pt"  # the end of fit's (its step is checked below)
    dictionaries, meta = _load(path, ckpt_path)
    for name in names:
        d, sizes = dictionaries.get(name), list(model.quantizers[name].codebook_sizes)
        if d is None or d.total == 0 or list(d.codebook_sizes) != sizes:
            got = (f"no {name} dictionary" if d is None else f"the {name} dictionary is empty" if d.total == 0 else
                   f"{name} codebook sizes {list(d.codebook_sizes)}, but the checkpoint's are {sizes}")
            raise DataError(f"{path}: {got} (`lwm codes --ckpt_path {ckpt_path}` makes the checkpoint's)")
    if meta.get("global_step") not in (None, global_step):
        print(f"warning: {path} was made by the encoders of step {meta['global_step']}, the checkpoint is at step "
              f"{global_step}: its codes may not be the ones this model uses (`lwm codes --ckpt_path {ckpt_path}` "
              f"makes its own)", file=sys.stderr)
    return dictionaries


def _load(path: str | Path, ckpt_path: Path | None = None, mmap: bool = False) -> tuple[dict, dict]:
    """``({name: dictionary}, {meta key: value})`` of a file :func:`save_dictionaries` wrote; else one line."""
    path = Path(path)
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        states = {k: state for k, state in raw.items() if isinstance(state, dict)} if isinstance(raw, dict) else {}
        foreign = [f"{name} holds {', '.join(map(str, state))[:100]}" for name, state in states.items()
                   if set(state) != STATE_KEYS] if isinstance(raw, dict) else [f"a {type(raw).__name__}"]
        why = f"{foreign[0]}, not {', '.join(sorted(STATE_KEYS))}" if foreign else ""  # a checkpoint's, say
    except Exception as e:  # missing, torn, foreign
        why = torch_load_failure(e, path)
    if why:
        raise DataError(f"{path}: not a code dictionary of `lwm codes` ({why})" if path.is_file() else
                        f"{path}: code dictionary not found (`lwm codes --ckpt_path {ckpt_path or 'CKPT'}` writes "
                        f"one; --codes FILE gives another)")
    return ({name: CodeDictionary.from_state(state) for name, state in states.items()},
            {k: v for k, v in raw.items() if k not in states})


@torch.no_grad()
def collect(model, loader, device: torch.device,
            forward_context: Callable[[], ContextManager] = contextlib.nullcontext,
            ) -> tuple[dict[str, CodeDictionary], int]:
    """Count the action and world code tuples of ``model`` (a WorldModel, eval mode) on the windows of ``loader``."""
    dictionaries = {name: CodeDictionary(q.codebook_sizes) for name, q in model.quantizers.items()}
    windows = 0
    paths = getattr(getattr(loader, "dataset", None), "paths", None)
    for batch in loader:
        if paths is not None and (bad := nonfinite_windows(batch, paths)):  # they would count as codes
            raise DataError(f"non-finite latents (NaN/inf) in {len(bad)} window(s): {', '.join(bad[:5])}; run "
                            f"`lwm data index` on the folder again")
        x = batch["latents"].to(device).float()
        with forward_context():
            actions, world = model.encode_actions(x).indices, model.encode_world(x).indices
        dictionaries["Action_Encoder"].update(actions)
        dictionaries["World_Encoder"].update(world)
        windows += x.shape[0]
    return dictionaries, windows
