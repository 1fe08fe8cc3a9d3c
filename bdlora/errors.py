"""Typed errors. The CLI turns them into one red line on stderr: exit 2 for bad usage, 1 for failures."""


class BdloraError(Exception):
    """Base class of every error bdlora raises on purpose."""

    exit_code = 1


class UsageError(BdloraError):
    """The user asked for something invalid (a bad value, a missing path, an incompatible option)."""

    exit_code = 2


class ConfigError(UsageError):
    """One or more option values are invalid; the message lists every problem at once (litgpt style)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


class DataError(UsageError):
    """The corpus cannot be used (missing, empty, too short for one block, unknown format)."""


class ModelError(UsageError):
    """A model or checkpoint cannot be used (missing, corrupt, wrong architecture, mismatched vocabulary)."""


class RunDirError(UsageError):
    """A directory that should be a bdlora run is not one (or is incomplete)."""


class TrainingError(BdloraError):
    """Training failed for a reason that is not the user's input (e.g. the loss became NaN)."""
