"""Our own forward passes. The Llama family shares one implementation; Gemma 4's text model
(engine.models.gemma4) and the hybrid linear-attention models (Qwen3.5, Qwen3-Next:
engine.models.qwen3_5) are LlamaFamilyModels with their own layers."""
from engine.models.gemma4 import GEMMA4_MODEL_TYPES, Gemma4Model, is_gemma4
from engine.models.hybrid import is_hybrid
from engine.models.llama import SUPPORTED_MODEL_TYPES as LLAMA_FAMILY_TYPES
from engine.models.llama import LlamaFamilyModel
from engine.models.qwen3_5 import HybridModel

SUPPORTED_MODEL_TYPES = LLAMA_FAMILY_TYPES + GEMMA4_MODEL_TYPES


def build_model(config, max_positions: int | None = None) -> LlamaFamilyModel:
    """The forward pass for a transformers config (built on the current default device)."""
    if is_gemma4(config):
        return Gemma4Model(config, max_positions=max_positions)
    if is_hybrid(config):
        return HybridModel(config, max_positions=max_positions)
    return LlamaFamilyModel(config, max_positions=max_positions)


__all__ = ["SUPPORTED_MODEL_TYPES", "LlamaFamilyModel", "build_model"]
