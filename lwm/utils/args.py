"""argparse for lwm's verbs (one-line refusals, defaults in help, typed values); Lightning verbs' for jsonargparse."""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable, Iterable
from typing import Any

from lwm.utils.errors import ConfigError

MAX_FPS = 1000  # frames per second a video is written at, at most


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows an option's default where there is one to show and its help does not say it already."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text, default = action.help or "", action.default
        if ("(default" in text or default is None or default is False or default == [] or default == argparse.SUPPRESS
                or not action.option_strings):
            return text
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose refusals are one :class:`ConfigError` line, without the usage block."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)  # `--step` is not `--steps`
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        raise ConfigError(f"{self.prog}: {message} (`{self.prog} --help` for the options)")


def bounded(kind: type = int, low: float | None = None, high: float | None = None, *, open_low: bool = False,
            open_high: bool = False, multiple: int = 1) -> Callable[[str], float]:
    """An argparse ``type``: a finite ``kind`` between ``low`` and ``high`` (each included unless open), a multiple
    of ``multiple``."""
    span = f"{'(' if open_low else '['}{'-inf' if low is None else low}, {'inf' if high is None else high}" \
           f"{')' if open_high else ']'}"
    what = f"{'an integer' if kind is int else 'a number'} in {span}" + (f", a multiple of {multiple}"
                                                                        if multiple > 1 else "")

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = math.nan
        inside = (math.isfinite(value) and (low is None or value > low or (value == low and not open_low))
                  and (high is None or value < high or (value == high and not open_high)))
        if not inside or (multiple > 1 and value % multiple):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    parse.__name__ = kind.__name__
    return parse


positive_int = bounded(int, 1)
non_negative_int = bounded(int, 0)
fraction = bounded(float, 0, 1, open_high=True)  # a share of the files, e.g. --val-fraction
frame_rate = bounded(float, 0, MAX_FPS, open_low=True)  # frames per second of a video


_ABSOLUTE = re.compile(r"\$\{([A-Za-z_][\w.]*)\}")  # ${trainer.default_root_dir}, not ${..x} nor ${oc.env:X}


def relative_interpolations(args: list[str]) -> list[str]:
    """Command-line ``${a.b}`` made relative to its key, as jsonargparse makes a config file's
    (``--checkpoint.dirpath '${trainer.default_root_dir}/c'`` -> ``${..trainer.default_root_dir}/c``)."""
    out = [str(a) for a in args]
    for i, arg in enumerate(out):
        if "${" not in arg:
            continue
        if arg.startswith("--") and "=" in arg:
            key, value = arg[2:].split("=", 1)
        elif i and out[i - 1].startswith("--") and "=" not in out[i - 1]:
            key, value = out[i - 1][2:], arg
        else:
            continue
        value = _ABSOLUTE.sub(lambda match: _relative_to(key, match[1]), value)
        out[i] = f"--{key}={value}" if arg.startswith("--") else value
    return out


def _relative_to(key: str, target: str) -> str:
    """``${target}`` as written in the value of ``key``."""
    path, target_path = key.split("."), target.split(".")
    common = len(os.path.commonprefix([path, target_path]))
    return "${" + "." * max(1, len(path) - common) + ".".join(target_path[common:]) + "}"


def negative_values_joined(args: list[str]) -> list[str]:
    """``--key -1e-3`` as ``--key=-1e-3``: argparse takes a value that starts with ``-`` and is no plain decimal (an
    exponent, ``-inf``) for an option."""
    out: list[str] = []
    for arg in map(str, args):
        if out and out[-1].startswith("--") and "=" not in out[-1] and arg.startswith("-") and _is_number(arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _configs(args: list[str]) -> list[tuple[int, str]]:
    """``(position, file)`` of each ``--config`` among ``args``."""
    return [(i, a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args) else ""))
            for i, a in enumerate(map(str, args)) if a in ("-c", "--config") or a.startswith("--config=")]


def config_files(args: list[str]) -> list[str]:
    """The ``--config`` files among ``args``, in order."""
    return [path for _, path in _configs(args)]


_UNSET = object()


def _yaml(path: str) -> Any:
    import yaml

    try:
        with open(path) as f:
            return yaml.safe_load(f)
    except Exception:  # (jsonargparse names a missing or broken file)
        return None


def _get(node: Any, key: str) -> Any:
    """The dotted ``key``'s value in ``node`` (``_UNSET`` where unset)."""
    for part in key.split("."):
        node = node.get(part, _UNSET) if isinstance(node, dict) else _UNSET
    return node


def check_config_files(args: list[str], sections: Iterable[str]) -> None:
    """Refuse what jsonargparse takes with a traceback or silently: an empty or single-value section of a
    ``--config`` file, and an override before a ``--config`` file that sets it again (the later file wins)."""
    args = [str(a) for a in args]
    configs = [(i, path, _yaml(path)) for i, path in _configs(args)]
    for _, path, doc in configs:
        for name in sections:
            if (value := _get(doc, name)) is not _UNSET and not isinstance(value, dict):
                raise ConfigError(f"--config {path}: {name} is {'empty' if value is None else repr(value)}, not a "
                                  f"section of keys (give it keys, or leave it out)")
    for i, arg in enumerate(args):
        key = arg[2:].split("=", 1)[0]
        if not arg.startswith("--") or key == "config":
            continue
        later = [path for j, path, doc in configs if j > i and _get(doc, key) is not _UNSET]
        if later:
            raise ConfigError(f"--{key} comes before --config {later[-1]}, which sets it again (a later config wins): "
                              f"put the overrides after the --config files")
