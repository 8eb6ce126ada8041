"""argparse for lwm's own verbs: refusals as one line, options shown with their defaults, typed values."""

from __future__ import annotations

import argparse
import math

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

def positive_int(text: str) -> int:
    """An argparse ``type``: an integer >= 1 (argparse prints the refusal as one line naming the option)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value

def positive_float(text: str) -> float:
    """An argparse ``type``: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value

def frame_rate(text: str) -> float:
    """An argparse ``type``: a frame rate, a number in (0, :data:`MAX_FPS`]."""
    value = positive_float(text)
    if value > MAX_FPS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_FPS} frames per second, got {text}")
    return value
