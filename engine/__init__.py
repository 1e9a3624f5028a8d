"""Inference engine: our own Llama-family forward pass over a paged, prefix-cached,
FP8-capable GQA KV cache. Never imports Qt."""
from engine.config import EngineConfig, SamplingParams
from engine.errors import WorkbenchError

__all__ = ["EngineConfig", "SamplingParams", "WorkbenchError", "LLMEngine"]


def __getattr__(name):
    # Lazy so `import engine` stays cheap (no transformers import until an engine is built).
    if name == "LLMEngine":
        from engine.engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)
