"""kv_cache_dtype "fp8_when_short": the cache stays in the model's dtype until the pool runs short
(less than one full context, or a request preempted for want of blocks), then FP8, rebuilt
when nothing runs; the engine says which and why."""
import torch

from engine import SamplingParams
from engine.cache.kv_cache import FP8_DTYPE


def _engine(tiny_model, **config):
    from engine import EngineConfig
    from engine.engine import LLMEngine
    return LLMEngine(tiny_model, EngineConfig(compile="off", kv_cache_dtype="fp8_when_short", **config),
                     torch.device("cpu"))


def test_a_pool_that_holds_a_context_stays_in_the_models_dtype(tiny_model):
    eng = _engine(tiny_model, kv_cache_bytes=8 * 2**20, max_model_len=256)
    assert eng.runner.kv.dtype == torch.float32
    s = eng.settings()
    assert s["kv_cache_dtype"] == "float32"
    assert s["kv_cache_why"] == "the model's dtype: the pool has not run short"


def test_a_pool_short_of_one_context_is_fp8_from_the_start_with_its_exact_bytes(tiny_model):
    shape = tiny_model.model.cache_shape
    per_block = 16 * shape.bytes_per_token(torch.float32)
    eng = _engine(tiny_model, kv_cache_bytes=10 * per_block, max_model_len=256)    # 160 tokens < 256
    assert eng.runner.kv.dtype == FP8_DTYPE
    fp8_block = 16 * (shape.bytes_per_token(FP8_DTYPE) + shape.scale_bytes_per_token(FP8_DTYPE))
    assert eng.runner.kv.num_blocks == 10 * per_block // fp8_block
    assert eng.settings()["kv_cache_why"] == ("FP8 since the pool in the model's dtype holds 160 tokens, "
                                              "less than one full context (256)")


def test_a_preemption_makes_the_pool_fp8_once_nothing_runs(tiny_model):
    eng = _engine(tiny_model, num_blocks=6, block_size=16, max_model_len=96)
    assert eng.runner.kv.dtype == torch.float32                    # 96 tokens hold one context
    params = SamplingParams(max_tokens=40)
    for i in range(3):                  # each starts in 2 blocks and ends in 4: 12 > 6
        eng.submit(list(range(100 + 30 * i, 120 + 30 * i)), params)
    preempted = 0
    while eng.has_work:
        for e in eng.step():
            preempted += e.finished and e.summary.preemptions
        assert eng.runner.kv.dtype == torch.float32 or not eng.has_work     # never rebuilt mid-run
    assert preempted >= 1
    assert eng.settings()["kv_cache_why"].startswith("FP8 since 1 request preempted for want of blocks at step")
    eng.submit([1, 2, 3], SamplingParams(max_tokens=2))             # idle: the pool is rebuilt first
    assert eng.runner.kv.dtype == FP8_DTYPE
    assert eng.settings()["kv_cache_dtype"] == "fp8_e4m3"
    while eng.has_work:
        eng.step()
    eng.reconfigure(kv_cache_dtype="auto")
    eng.reconfigure(kv_cache_dtype="fp8_when_short")               # chosen again: the model's dtype first
    assert eng.runner.kv.dtype == torch.float32
