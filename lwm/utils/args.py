"""argparse for lwm's own verbs: refusals as one line, options shown with their defaults, typed values."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from lwm.utils.errors import ConfigError

MAX_FPS = 1000  # frames per second a video is written at, at most


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default, except where its help says it already or there is none to show (None,
    False: an unset option, a flag)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if ("(default" in text or default is None or default is False or default == [] or default == argparse.SUPPRESS
                or not action.option_strings):
            return text
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose refusals are one line, a :class:`ConfigError` (``error: lwm VERB: MESSAGE``, exit 2),
    instead of the usage block and the message."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)  # `--step` is not `--steps`: a prefix is refused, not guessed
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        raise ConfigError(f"{self.prog}: {message} (`{self.prog} --help` for the options)")


def bounded(kind: type = int, low: float | None = None, high: float | None = None, *, open_low: bool = False,
            open_high: bool = False, multiple: int = 1) -> Callable[[str], float]:
    """An argparse ``type``: a finite ``kind`` (int or float) between ``low`` and ``high`` (each included unless
    open), a multiple of ``multiple``; argparse names the option in its one-line refusal."""
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
