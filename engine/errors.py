"""User-facing errors. Each message names what was wrong and what to do."""


class WorkbenchError(Exception):
    """Base class for errors the app shows to the user verbatim."""


class ModelNotFoundError(WorkbenchError):
    pass


class UnsupportedModelError(WorkbenchError):
    pass


class PromptTooLongError(WorkbenchError):
    pass


class CacheTooSmallError(WorkbenchError):
    pass


class DraftIncompatibleError(WorkbenchError):
    pass


class ConfigError(WorkbenchError, ValueError):
    pass
