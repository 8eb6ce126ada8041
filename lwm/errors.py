"""lwm's errors. The ``lwm`` command prints them as one ``error: ...`` line per problem and exits 2."""

import argparse
import math


class LwmError(ValueError):
    """A problem the user can fix; the message names the file or config field."""


class DataError(LwmError):
    """Bad input data. One line per problem, each naming the file (and the dataset or field)."""


class ConfigError(LwmError):
    """An invalid or inconsistent configuration; the message names the field (e.g. ``model.net.d_model``)."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (h5py and torch errors run over several lines), for one-line errors."""
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


class NonFiniteLossError(RuntimeError):
    """Training stopped: too many consecutive steps had a non-finite loss or gradient."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose refusals are one line, a :class:`ConfigError` (``error: lwm VERB: MESSAGE``, exit 2),
    instead of the usage block and the message; ``--help`` prints the usage as usual. Subparsers are of this class
    too."""

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
