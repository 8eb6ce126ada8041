"""Code dictionaries: which code tuples (one index per RVQ level) the trained encoders use, and how often."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from lwm.data.windows import nonfinite_windows
from lwm.training.checkpoint import atomic_save
from lwm.utils.errors import ConfigError, DataError, torch_load_failure
from lwm.utils.video import check_output

SAMPLING = ("frequency", "uniform")


@dataclass
class CodeDictionary:
    """Counts of code tuples ``[L]`` of one quantizer with ``codebook_sizes``."""

    codebook_sizes: tuple[int, ...]
    tuples: Tensor = field(default=None)  # [U, L] int64, unique, sorted
    counts: Tensor = field(default=None)  # [U] int64

    def __post_init__(self) -> None:
        L = len(self.codebook_sizes)
        if self.tuples is None:
            self.tuples = torch.zeros(0, L, dtype=torch.long)
            self.counts = torch.zeros(0, dtype=torch.long)

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def update(self, indices: Tensor) -> None:
        """Count the tuples of ``indices [..., L]`` (on any device; kept on the CPU)."""
        L = len(self.codebook_sizes)
        if indices.shape[-1] != L:
            raise ValueError(f"indices: expected {L} levels in the last dim, got {tuple(indices.shape)}")
        flat = torch.cat([self.tuples, indices.reshape(-1, L).long().cpu()])
        weights = torch.cat([self.counts, torch.ones(flat.shape[0] - self.tuples.shape[0], dtype=torch.long)])
        self.tuples, inverse = torch.unique(flat, dim=0, return_inverse=True)
        self.counts = torch.zeros(self.tuples.shape[0], dtype=torch.long).index_add_(0, inverse, weights)

    def merge(self, other: CodeDictionary) -> None:
        """Add another dictionary's counts (e.g. another rank's)."""
        if tuple(other.codebook_sizes) != tuple(self.codebook_sizes):
            raise ValueError(f"codebook sizes differ: {self.codebook_sizes} vs {other.codebook_sizes}")
        flat = torch.cat([self.tuples, other.tuples])
        weights = torch.cat([self.counts, other.counts])
        self.tuples, inverse = torch.unique(flat, dim=0, return_inverse=True)
        self.counts = torch.zeros(self.tuples.shape[0], dtype=torch.long).index_add_(0, inverse, weights)

    def sample(self, shape: tuple[int, ...], by: str = "frequency", generator: torch.Generator | None = None) -> Tensor:
        """Tuples ``[*shape, L]`` drawn by frequency or uniformly over the used tuples, independently, in row-major
        order."""
        if by not in SAMPLING:
            raise ValueError(f"sampling must be one of {SAMPLING}, got {by!r}")
        if self.tuples.shape[0] == 0:
            raise ValueError("the code dictionary is empty: nothing to sample")
        weights = self.counts.double() if by == "frequency" else torch.ones(self.tuples.shape[0], dtype=torch.double)
        n = 1
        for s in shape:
            n *= s
        cdf = weights.cumsum(0)
        u = torch.rand(n, dtype=torch.double, generator=generator) * cdf[-1]
        picks = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.numel() - 1)
        return self.tuples[picks].reshape(*shape, len(self.codebook_sizes))

    def to_state(self) -> dict[str, Tensor]:
        return {"tuples": self.tuples, "counts": self.counts,
                "codebook_sizes": torch.tensor(self.codebook_sizes, dtype=torch.long)}

    @classmethod
    def from_state(cls, state: dict[str, Tensor]) -> CodeDictionary:
        """The dictionary of :meth:`to_state`'s tensors, checked: a ``ValueError`` says what is wrong in one line."""
        check_state(state)
        return cls(tuple(int(k) for k in state["codebook_sizes"]), state["tuples"].long(), state["counts"].long())


def _integer(t: Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


def check_state(state: dict[str, Tensor]) -> None:
    """Refuse a dictionary's tensors that sampling or decoding would trip on."""
    if set(state) != STATE_KEYS:
        raise ValueError(f"expected the tensors {', '.join(sorted(STATE_KEYS))}, got {', '.join(map(str, state))}")
    if bad := [k for k in sorted(state) if not isinstance(state[k], Tensor)]:
        raise ValueError(f"{', '.join(bad)}: not a tensor")
    sizes, tuples, counts = state["codebook_sizes"], state["tuples"], state["counts"]
    if not _integer(sizes) or sizes.ndim != 1 or sizes.numel() == 0 or int(sizes.min()) < 1:
        raise ValueError(f"codebook_sizes must be integers >= 1, one per RVQ level, got {sizes.tolist()}")
    L = sizes.numel()
    if not _integer(tuples) or tuples.ndim != 2 or tuples.shape[1] != L:
        raise ValueError(f"tuples must be integers of shape [U, {L}] (one code per RVQ level), got {tuples.dtype} "
                         f"{list(tuples.shape)}")
    U = tuples.shape[0]
    if not _integer(counts) or counts.shape != (U,):
        raise ValueError(f"counts must be integers of shape [{U}] (one per tuple), got {counts.dtype} "
                         f"{list(counts.shape)}")
    if U and int(counts.min()) < 1:  # a listed tuple was used
        raise ValueError(f"counts must be >= 1 (each tuple was used), got {int(counts.min())}")
    if U and torch.unique(tuples, dim=0).shape[0] != U:
        raise ValueError(f"tuples must be distinct, got {U - torch.unique(tuples, dim=0).shape[0]} repeated")
    for level, k in enumerate(sizes.tolist()):
        if (bad := ((tuples[:, level] < 0) | (tuples[:, level] >= k)).nonzero()).numel():
            i = int(bad[0])
            raise ValueError(f"tuple {i} {tuples[i].tolist()} has code {int(tuples[i, level])} at level {level}, "
                             f"which takes codes 0..{k - 1}")


def save_dictionaries(path: str | Path, dictionaries: dict[str, CodeDictionary], windows: int,
                      global_step: int | None = None) -> Path:
    """Write ``codes.pt`` atomically; ``global_step``: the encoders' checkpoint step."""

    check_output(path, "the code dictionary")  # a folder in the way
    meta = {"windows": windows, **({"global_step": int(global_step)} if global_step is not None else {})}
    return atomic_save({**{k: d.to_state() for k, d in dictionaries.items()}, **meta}, path)


STATE_KEYS = {"tuples", "counts", "codebook_sizes"}  # a dictionary's entry in the file
META_KEYS = {"windows", "global_step"}


def check_out(path: str | Path) -> Path:
    """Refuse ``lwm codes --out`` before any encoding, with one line naming it."""

    path = Path(path)
    if path.suffix == ".ckpt":  # resuming (last.ckpt, hpc_ckpt_N.ckpt) and people take a .ckpt for a checkpoint
        raise ConfigError(f"--out {path}: a .ckpt name is a checkpoint's; name the code dictionary e.g. codes.pt")
    check_output(path, "--out")
    if path.exists() and not is_dictionary_file(path):
        raise DataError(f"--out {path}: exists and is not a code dictionary, refusing to replace it (remove it or "
                        f"choose another --out)")
    return path


def is_dictionary_file(path: str | Path) -> bool:
    """Whether ``path`` holds what :func:`save_dictionaries` writes (loaded with ``weights_only=True``,
    memory-mapped: a checkpoint given by mistake is not read into memory)."""
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # JSON, h5, a torn file: not one of ours
        return False
    if not isinstance(raw, dict) or not isinstance(raw.get("windows"), int):
        return False
    states = [v for v in raw.values() if isinstance(v, dict)]
    return (bool(states) and set(raw) - META_KEYS == {k for k, v in raw.items() if isinstance(v, dict)}
            and all(set(v) == STATE_KEYS and all(isinstance(t, torch.Tensor) for t in v.values()) for v in states))


def default_codes_path(ckpt_path: str | Path) -> Path:
    """Where a checkpoint's code dictionaries go."""
    ckpt_path = Path(ckpt_path)
    return ckpt_path.parent / ("codes.pt" if ckpt_path.name == "last.ckpt" else f"{ckpt_path.stem}.codes.pt")


def load_dictionaries(path: str | Path) -> dict[str, CodeDictionary]:
    return _load(path)[0]


def dictionaries_step(path: str | Path) -> int | None:
    """The checkpoint step whose encoders made the dictionaries at ``path`` (None: not recorded)."""
    return _load(path)[1].get("global_step")


def _load(path: str | Path) -> tuple[dict[str, CodeDictionary], dict]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: code dictionary not found (`lwm codes --config CFG --ckpt_path CKPT` writes one)")
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a torn or foreign file
        raise DataError(f"{path}: not a code dictionary of `lwm codes` ({torch_load_failure(e, path)})") from None
    if not isinstance(raw, dict):
        raise DataError(f"{path}: not a code dictionary of `lwm codes` (a {type(raw).__name__})")
    dictionaries = {}
    for name, state in raw.items():
        if not isinstance(state, dict):
            continue
        if set(state) != STATE_KEYS:  # a checkpoint's state_dict, say
            raise DataError(f"{path}: not a code dictionary of `lwm codes` ({name} holds "
                            f"{', '.join(map(str, state))[:100]}, not {', '.join(sorted(STATE_KEYS))})")
        try:
            dictionaries[name] = CodeDictionary.from_state(state)
        except ValueError as e:  # an edited or corrupted file
            raise DataError(f"{path}: {name}: {e}") from None
    return dictionaries, {k: v for k, v in raw.items() if not isinstance(v, dict)}


@torch.no_grad()
def collect(model, loader, device: torch.device, max_windows: int | None = None,
            forward_context: Callable[[], ContextManager] = contextlib.nullcontext,
            ) -> tuple[dict[str, CodeDictionary], int]:
    """Encode the windows of ``loader`` (batches with ``latents``) with ``model`` (a WorldModel, eval mode) and count
    the action and world code tuples."""
    quantizers = model.quantizers
    dictionaries = {name: CodeDictionary(q.codebook_sizes) for name, q in quantizers.items()}
    windows = 0
    paths = getattr(getattr(loader, "dataset", None), "paths", None)
    for batch in loader:
        if paths is not None and (bad := nonfinite_windows(batch, paths)):  # they would count as codes
            raise DataError(f"non-finite latents (NaN/inf) in {len(bad)} window(s): {', '.join(bad[:5])}; run "
                            f"`lwm data index` on the folder again")
        x = batch["latents"].to(device).float()  # float16 files stay float16 through the loader
        if max_windows is not None:
            x = x[: max_windows - windows]
            if x.shape[0] == 0:
                break
        with forward_context():
            actions, world = model.encode_actions(x).indices, model.encode_world(x).indices
        dictionaries["Action_Encoder"].update(actions)
        dictionaries["World_Encoder"].update(world)
        windows += x.shape[0]
    return dictionaries, windows
