"""The compiled decode and verify step (torch.compile) against the eager reference, end to
end on the tiny model: greedy output token-identical, with and without an FP8 cache and
with speculation (verify passes of k + 1 tokens), and the cache written exactly once."""
import pytest
import torch

from engine import SamplingParams
from engine.errors import ConfigError

GREEDY = SamplingParams(max_tokens=12, stop_on_eos=False)


def repeating_prompt(eng) -> list[int]:
    """A question, the model's own greedy answer, the question again: the answer repeats, so
    n-gram lookup proposes drafts (the random tiny model otherwise rarely repeats itself)."""
    question = eng.encode([{"role": "user", "content": "Tell me a story."}])
    return question + eng.generate_text(question, GREEDY)[1] + question


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_compiled_steps_give_the_eager_tokens_and_cache(make_tiny_engine, kv):
    eager = make_tiny_engine(kv_cache_dtype=kv, proposer="ngram", num_speculative_tokens=1, compile="off")
    compiled = make_tiny_engine(kv_cache_dtype=kv, proposer="ngram", num_speculative_tokens=1, compile="on")
    assert compiled.settings()["compile"] == "on" and eager.settings()["compile"] == "off"
    prompt = repeating_prompt(make_tiny_engine())      # both engines then start from an empty pool
    _, expected, _ = eager.generate_text(prompt, GREEDY)
    _, got, stats = compiled.generate_text(prompt, GREEDY)
    assert got == expected
    assert stats.proposed > 0                           # verify passes (2 tokens) ran compiled too
    assert set(compiled.runner.compiled.compiled_counts) >= {1, 2}
    # The K/V written after each compiled pass are what the eager path stored (FP8: the same
    # bytes; fp32: the same up to the compiled kernels' summation order).
    ours, reference = compiled.runner.kv, eager.runner.kv
    if kv == "fp8_e4m3":
        assert torch.equal(ours.k.view(torch.uint8), reference.k.view(torch.uint8))
        assert torch.allclose(ours.v_scale, reference.v_scale, rtol=1e-6)
    else:
        assert torch.allclose(ours.k, reference.k, atol=1e-4) and torch.allclose(ours.v, reference.v, atol=1e-4)
    assert ours.k.view(torch.uint8).any()                  # something was written


def test_compile_setting_is_checked_and_applies_between_requests(make_tiny_engine):
    eng = make_tiny_engine(compile="off")
    with pytest.raises(ConfigError, match="compile"):
        eng.reconfigure(compile="sometimes")
    result = eng.reconfigure(compile="auto")       # fp32 weights on the CPU: auto stays eager
    assert result.applied == {"compile": "auto"} and eng.settings()["compile"].startswith("off (auto")


def test_compiled_graphs_are_cached_in_the_user_cache_folder(make_tiny_engine):
    """Importing torch._dynamo points inductor at torch's /tmp default; ours wins over that."""
    import os
    from pathlib import Path

    from engine.loading.loader import cache_dir
    eng = make_tiny_engine(compile="on")
    eng.generate_text([1, 2, 3, 4], SamplingParams(max_tokens=3, stop_on_eos=False))
    folder = cache_dir() / "inductor"
    assert Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) == folder
    assert any((folder / "fxgraph").rglob("*"))


def test_compiling_is_reported_once_per_cache_dtype(make_tiny_engine):
    """The app shows "compiling…" while a graph compiles: at the first step, and again when a
    new KV dtype makes inductor compile once more; not on every new token count."""
    eng = make_tiny_engine(compile="on", proposer="ngram", num_speculative_tokens=2)
    messages = []
    eng.runner.compiled.progress = lambda message, fraction: messages.append((message.split(" ")[0], fraction))
    prompt = repeating_prompt(make_tiny_engine())
    eng.generate_text(prompt, GREEDY)
    assert messages == [("compiling", 0.0), ("compiled", 1.0)]
    eng.reconfigure(kv_cache_dtype="fp8_e4m3")                  # a new pool, same compiled step
    eng.generate_text(prompt, GREEDY)
    assert messages == [("compiling", 0.0), ("compiled", 1.0)] * 2


def test_a_failing_compiled_step_falls_back_to_eager_and_says_why(make_tiny_engine):
    """E.g. CUDA graph capture failing on a driver: the reply goes on eagerly, token for token
    what the eager path gives, and settings() (sent with the next event) names the reason."""
    prompt = repeating_prompt(make_tiny_engine())
    expected = make_tiny_engine(compile="off").generate_text(prompt, GREEDY)[1]
    eng = make_tiny_engine(compile="on")

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA graph capture failed: operation not permitted\nthe rest of the trace")
    eng.runner.compiled._compiled = broken
    events = list(eng.generate(prompt, GREEDY))
    assert [t for e in events for t in e.token_ids] == expected
    reason = ("off: the compiled step failed (RuntimeError: CUDA graph capture failed: operation not permitted); "
              "running eagerly")
    assert eng.settings()["compile"] == reason and eng.runner.compiled is None
    assert [e.settings["compile"] for e in events if e.settings] == ["on", reason]
    eng.reconfigure(compile="off")
    eng.reconfigure(compile="on")                                     # stays off, and still says why
    assert eng.settings()["compile"] == reason


def test_a_block_table_padded_to_buckets_gives_the_same_tokens(make_tiny_engine):
    """On CUDA the table grows in buckets (one CUDA graph per bucket); the padding is masked,
    so the output is the unpadded step's. Checked here with buckets of 8 blocks (the chat
    fills fewer, so every step reads masked padding)."""
    prompt = repeating_prompt(make_tiny_engine())
    plain = make_tiny_engine(compile="on", proposer="ngram", num_speculative_tokens=3)
    bucketed = make_tiny_engine(compile="on", proposer="ngram", num_speculative_tokens=3)
    bucketed.runner.compiled.table_bucket = 8
    assert -(-(len(prompt) + GREEDY.max_tokens) // bucketed.config.block_size) < 8
    assert bucketed.generate_text(prompt, GREEDY)[1] == plain.generate_text(prompt, GREEDY)[1]


# ---- a compile is never timed as decoding ---------------------------------------------------
def test_a_step_that_compiles_is_marked_and_left_out_of_decode_speed(make_tiny_engine):
    eng = make_tiny_engine(compile="on")
    events = list(eng.generate([1, 2, 3, 4], SamplingParams(max_tokens=6, stop_on_eos=False)))
    decode = [e for e in events if e.is_decode]
    assert decode[0].compile_s > 0                        # the first decode step compiled the graph
    assert all(e.compile_s == 0 for e in decode[1:])       # and no other step did
    assert decode[0].as_dict()["step_tok_s"] is None       # a compiling step has no speed of its own
    summary = events[-1].summary
    assert summary.compile_s == decode[0].step_time_s and summary.compile_tokens == decode[0].num_tokens
    timed = decode[1:]
    assert summary.decode_tok_s == pytest.approx(sum(e.num_tokens for e in timed) / sum(e.step_time_s for e in timed))
    assert summary.tpot_s == pytest.approx(summary.decode_time_s / (summary.generated_tokens - 1))  # wall time


def test_warming_compiles_now_so_that_no_reply_step_compiles(make_tiny_engine):
    eng = make_tiny_engine(compile="on", enable_prefix_caching=True)
    messages = []
    eng.progress = eng.runner.progress = eng.runner.compiled.progress = lambda m, f: messages.append((m, f))
    assert eng.warm_compiled_step() > 0
    assert [f for _, f in messages] == [0.0, 1.0] and "compiling" in messages[0][0]
    assert eng.runner.blocks.num_used_blocks == 0 and eng.warm_compiled_step() == 0.0      # nothing left, once
    events = list(eng.generate([1, 2, 3, 4], SamplingParams(max_tokens=6, stop_on_eos=False)))
    assert all(e.compile_s == 0 for e in events) and events[-1].summary.compile_s == 0
    assert make_tiny_engine(compile="off").warm_compiled_step() == 0.0        # eager: nothing to build


def test_decode_speed_leaves_out_compiling_steps():
    """engine.metrics' formula on made-up steps: 10 timed tokens in 1 s; a 30 s compile of 1 token."""
    from engine.metrics import RequestStats, StepEvent, combined

    def step(seconds, tokens=1, compile_s=0.0, ttft=None):
        return StepEvent(step=0, token_ids=[7] * tokens, token_kinds=["target"] * tokens, pieces=[], time_s=0.0,
                         step_time_s=seconds, target_time_s=seconds, draft_time_s=0.0, target_passes=1,
                         proposed=0, accepted=0, accepted_per_position=[], kv_bytes_used=0, kv_bytes_capacity=0,
                         kv_bytes_per_token=0, kv_dtype="float32", prefix_hit_tokens=0, prompt_tokens=4,
                         generated_tokens=0, ttft_s=ttft, compile_s=compile_s)
    stats = RequestStats()
    for event in [step(0.2, ttft=0.2), step(30.0, compile_s=29.9)] + [step(0.1)] * 10:
        stats.record_step(event)
    assert stats.decode_tok_s == pytest.approx(10.0)
    assert (stats.compile_s, stats.compile_tokens, stats.decode_tokens) == (30.0, 1, 11)
    assert combined([stats, stats]).decode_tok_s == pytest.approx(10.0)
    assert RequestStats.from_plain(stats.to_plain()).decode_tok_s == pytest.approx(10.0)
