import os

import pytest
import torch

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
torch.manual_seed(0)


@pytest.fixture(scope="session")
def default_model():
    """The embedded default model, loaded once per test session (converted on first use)."""
    from engine.loader import load_model
    return load_model("default")


@pytest.fixture
def make_engine(default_model):
    """A fresh engine (own cache and settings) around the shared default model."""
    from engine import EngineConfig
    from engine.engine import LLMEngine

    def make(**config):
        config.setdefault("kv_cache_bytes", 64 * 2**20)
        return LLMEngine(default_model, EngineConfig(**config), torch.device("cpu"))
    return make


def chat(text: str, system: str | None = None) -> list[dict]:
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": "user", "content": text}]
