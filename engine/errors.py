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


class CheckpointError(WorkbenchError):
    """A model file or folder that cannot be used as it is (a config that does not parse, a
    truncated shard, a tensor of the wrong shape, ...). The message names the file."""


# ---- remote servers (engine/remote/backend.py) ------------------------------------------------
class ServerError(WorkbenchError):
    """Something about an OpenAI-compatible server the workbench is attached to."""


class ServerUnreachableError(ServerError):
    pass


class NotOpenAIServerError(ServerError):
    pass


class ServerAuthError(ServerError):
    pass


class UnknownServedModelError(ServerError):
    pass


class ServerDiedError(ServerError):
    """The server stopped in the middle of a reply; the events before it were delivered."""


class ServerRequestError(ServerError):
    """The server refused or failed one request (its own message is quoted)."""


class ServerSettingFixedError(ConfigError):
    """A setting the server fixes at launch; the message names the launch flag."""


class LlamaServerMissingError(WorkbenchError):
    """llama.cpp's llama-server has not been built (scripts/build_llama_server.sh)."""


class VllmMissingError(WorkbenchError):
    """vLLM's CPU build has not been installed (scripts/build_vllm.sh)."""


def first_line(error: BaseException, limit: int = 200) -> str:
    """An exception's first line, short enough for "In effect" and a status bar."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:limit]
