"""Our own forward passes. The Llama family shares one implementation."""
from engine.models.llama import SUPPORTED_MODEL_TYPES, LlamaFamilyModel

__all__ = ["SUPPORTED_MODEL_TYPES", "LlamaFamilyModel"]
