"""What ``torch.compile`` (dynamo) did while ``lwm bench`` timed a variant: recompile-limit hits, graph breaks, frames
it could not compile and compilations during the timed steps (:class:`DynamoWatch`), said in one note per variant
(:func:`dynamo_note`); and :func:`fresh_compile_caches`, which each compiled variant starts from."""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar

import torch

ROOT = Path(__file__).resolve().parents[2]


def fresh_compile_caches() -> None:
    """``torch._dynamo.reset()``, before each compiled variant is built."""
    torch._dynamo.reset()


class DynamoWatch:
    """What dynamo did in one variant, from its first step to its last timed one (``torch._dynamo.utils.counters``
    and dynamo's recompile-limit warnings): all zero where nothing is compiled. :meth:`result`:"""

    active: ClassVar[DynamoWatch | None] = None  # the one watching now: StepClock's marks tell it
    LOGGER = "torch._dynamo.convert_frame"  # where dynamo warns "torch._dynamo hit config.recompile_limit

    def __init__(self) -> None:
        self.start, self.end = self.snapshot(), None
        self.timed_start: dict[str, Counter] | None = None  # at the first StepClock mark
        self.timed_end: dict[str, Counter] | None = None  # at the last one
        self.hit_functions: list[str] = []

    @staticmethod
    def snapshot() -> dict[str, Counter]:
        from torch._dynamo.utils import counters

        return {k: Counter(counters.get(k, {})) for k in ("unimplemented", "graph_break", "stats", "frames")}

    def timed_step_mark(self) -> None:
        self.timed_end = self.snapshot()
        if self.timed_start is None:
            self.timed_start = self.timed_end

    @classmethod
    @contextmanager
    def watching(cls) -> Iterator[DynamoWatch]:
        watch = cls()
        handler = _RecompileLimitHandler(watch.hit_functions)
        logger = logging.getLogger(cls.LOGGER)
        logger.addHandler(handler)
        cls.active = watch
        try:
            yield watch
        finally:
            cls.active = None
            logger.removeHandler(handler)
            watch.end = watch.snapshot()

    def result(self) -> dict:
        end = self.end if self.end is not None else self.snapshot()
        delta = {k: end[k] - self.start[k] for k in end}
        limit = Counter({m: n for m, n in delta["unimplemented"].items() if "recompile limit" in m.lower()})
        return {"graphs": delta["stats"]["unique_graphs"], "recompile_limit_hits": sum(limit.values()),
                "recompile_limit_functions": list(self.hit_functions),
                "graph_breaks": first_lines(delta["graph_break"]),
                "unsupported": first_lines(delta["unimplemented"] - limit),
                "compiles_in_timed_steps": None if self.timed_start is None
                else (self.timed_end["frames"] - self.timed_start["frames"])["total"]}


def first_lines(counts: Counter) -> dict[str, int]:
    """Dynamo's reasons (several lines each: explanation, hints) by their first line, with their counts."""
    out: Counter = Counter()
    for message, n in counts.items():
        out[(message.strip().splitlines() or [""])[0]] += n
    return dict(out)


class _RecompileLimitHandler(logging.Handler):
    """Collects the function named by each "torch._dynamo hit config.recompile_limit" warning."""

    PATTERN = re.compile(r"hit config\.(\w+) \(([^)]*)\)\s*function: ([^\n]+)")

    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        try:
            match = self.PATTERN.search(record.getMessage())
        except Exception:  # a record that does not format: not ours
            return
        if match:
            limit, value, function = match.groups()
            self.into.append(f"{short_path(function.strip())} ({limit} {value})")


def dynamo_note(label: str, d: dict) -> str | None:
    """One note when dynamo ran part of a variant's step uncompiled, or compiled during its timed steps."""
    problems = []
    if d["recompile_limit_hits"]:
        where = f" in {', '.join(d['recompile_limit_functions'])}" if d["recompile_limit_functions"] else ""
        problems.append(f"hit its recompile limit {d['recompile_limit_hits']} time(s){where}: from then on that "
                        "code runs uncompiled")
    if d["graph_breaks"]:
        problems.append(f"{sum(d['graph_breaks'].values())} graph break(s) ({'; '.join(d['graph_breaks'])})")
    if d["unsupported"]:
        problems.append(f"{sum(d['unsupported'].values())} frame(s) not compiled ({'; '.join(d['unsupported'])})")
    if d["compiles_in_timed_steps"]:
        problems.append(f"{d['compiles_in_timed_steps']} compilation(s) during the timed steps (more --warmup)")
    return f"{label}: dynamo: {'; '.join(problems)}: this row is mis-measured" if problems else None


def short_path(text: str) -> str:
    """Paths in ``text`` relative to the repository (``lwm/...``) or to site-packages (``torch/...``)."""
    text = text.replace(f"{ROOT}/", "")
    return re.sub(r"\S*/(?:site|dist)-packages/", "", text)
