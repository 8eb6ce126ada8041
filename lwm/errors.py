"""lwm's errors. The ``lwm`` command prints them as one ``error: ...`` line per problem and exits 2."""


class LwmError(ValueError):
    """A problem the user can fix; the message names the file or config field."""


class DataError(LwmError):
    """Bad input data. One line per problem, each naming the file (and the dataset or field)."""


class ConfigError(LwmError):
    """An invalid or inconsistent configuration; the message names the field (e.g. ``model.net.d_model``)."""


class NonFiniteLossError(RuntimeError):
    """Training stopped: too many consecutive steps had a non-finite loss or gradient."""
