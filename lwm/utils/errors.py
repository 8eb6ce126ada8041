"""lwm's errors. The ``lwm`` command prints them as one ``error: ...`` line per problem and exits 2."""

from pathlib import Path


class LwmError(ValueError):
    """A problem the user can fix; the message names the file or config field."""


class DataError(LwmError):
    """Bad input data."""


class ConfigError(LwmError):
    """An invalid or inconsistent configuration; the message names the field (e.g. ``model.net.d_model``)."""


def refuse_first(*checks: tuple[str, bool], error: type[LwmError] = ConfigError) -> None:
    """Raise ``error`` with the message of the first wrong ``(message, wrong)``: a verb's checks, before any work."""
    for message, wrong in checks:
        if wrong:
            raise error(message)


LISTED_PROBLEMS = 20  # bad files named one line each in a refusal


def refused(problems: list[str], total: int, where: str = "") -> "DataError":
    """One :class:`DataError` for ``problems`` (one line each, naming its file) among ``total`` files."""
    shown = problems[:LISTED_PROBLEMS]
    more = [f"... and {len(problems) - len(shown)} more"] if len(problems) > len(shown) else []
    return DataError(f"{len(problems)} of {total} files{where} refused:\n" + "\n".join(shown + more))


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (h5py and torch errors run over several lines), for one-line errors."""
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def torch_load_failure(e: BaseException, path: str | Path | None = None) -> str:
    """Why ``torch.load(weights_only=True)`` refused a file, in one line (``Type: reason``), without torch's advice of
    ``weights_only=False`` (lwm never unpickles arbitrary objects: a file that needs it is not one of ours)."""
    if path is not None and _truncated_zip(path):
        return "truncated or corrupt: a zip archive, as torch.save writes, but not a complete one"
    text = str(e)
    if "WeightsUnpickler error:" in text:  # torch's message: its advice, then the reason
        lines = [line.strip() for line in text.split("WeightsUnpickler error:", 1)[1].splitlines() if line.strip()]
        reason = lines[0].split(". Please use", 1)[0] if lines else "unsupported content"
        return f"torch.load with weights_only=True: {reason[:200]}"
    if text.startswith("Weights only load failed"):  # another torch's wording
        return "torch.load with weights_only=True refused it"
    if text.startswith("mmap can only be used with files saved with"):  # an h5 file, text: torch names its options
        return "not a torch.save file (or one in torch's old, non-zip format)"
    return f"{type(e).__name__}: {first_line(e)[:200]}"


def _truncated_zip(path: str | Path) -> bool:
    """Whether ``path`` starts as a zip archive (torch.save's format) but is not a readable one."""
    import zipfile

    try:
        with open(path, "rb") as f:
            return f.read(4) == b"PK\x03\x04" and not zipfile.is_zipfile(path)
    except OSError:
        return False


class NonFiniteLossError(RuntimeError):
    """Training stopped: too many consecutive steps had a non-finite loss or gradient."""
