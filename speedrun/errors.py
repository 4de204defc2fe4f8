"""Exceptions that mean "bad input or environment", reported by the CLI as one clear line."""


class SpeedrunError(Exception):
    """Base class: the message alone must tell the user what is wrong and how to fix it."""


class DataError(SpeedrunError, ValueError):
    """A data file or folder is missing, corrupt or does not match the model (names the file)."""


class ConfigError(SpeedrunError, ValueError):
    """A configuration value or combination is not supported."""


class EnvironmentProblem(SpeedrunError, RuntimeError):
    """The machine lacks something a run needs (GPU feature, package, network)."""
