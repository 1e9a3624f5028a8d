"""The compiled step (torch.compile, one graph for every pass) against the eager reference,
end to end on the tiny model: greedy output token-identical in fp32, with and without an FP8
cache and with speculation and trees; one graph for every row count, KV dtype and batch; the
compile reported once, never timed as decoding, and a failure handed over to eager."""
import pytest
import torch

from engine import SamplingParams
from engine.errors import ConfigError
from engine.runtime.compiled_step import compiled_graphs

GREEDY = SamplingParams(max_tokens=12, stop_on_eos=False)


def repeating_prompt(eng) -> list[int]:
    """A question, the model's own greedy answer, the question again: the answer repeats, so
    n-gram lookup proposes drafts (the random tiny model otherwise rarely repeats itself)."""
    question = eng.encode([{"role": "user", "content": "Tell me a story."}])
    return question + eng.generate_text(question, GREEDY)[1] + question


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_compiled_steps_give_the_eager_tokens_and_cache(make_tiny_engine, kv):
    """fp32: the compiled graph's rounding is close enough to eager's that greedy tokens agree,
    and the K/V it stores are eager's up to summation order (FP8: the scales too)."""
    eager = make_tiny_engine(kv_cache_dtype=kv, proposer="ngram", num_speculative_tokens=1, compile="off")
    compiled = make_tiny_engine(kv_cache_dtype=kv, proposer="ngram", num_speculative_tokens=1, compile="on")
    assert compiled.settings()["compile"] == "on" and eager.settings()["compile"] == "off"
    prompt = repeating_prompt(make_tiny_engine(compile="off"))   # both engines then start from an empty pool
    _, expected, _ = eager.generate_text(prompt, GREEDY)
    _, got, stats = compiled.generate_text(prompt, GREEDY)
    assert got == expected
    assert stats.proposed > 0                            # verify passes (2 tokens) ran compiled too
    assert {len(prompt), 1, 2} <= compiled.runner.compiled.row_counts
    ours, reference = compiled.runner.kv, eager.runner.kv
    if kv == "fp8_e4m3":
        same = (ours.k.view(torch.uint8) == reference.k.view(torch.uint8)).float().mean()
        assert same > 0.99 and torch.allclose(ours.k_scale, reference.k_scale, rtol=1e-4)
    else:
        assert torch.allclose(ours.k, reference.k, atol=1e-4) and torch.allclose(ours.v, reference.v, atol=1e-4)
    assert ours.k.view(torch.uint8).any()                  # something was written


def test_compile_setting_is_checked_and_applies_between_requests(make_tiny_engine):
    eng = make_tiny_engine(compile="off")
    with pytest.raises(ConfigError, match="compile"):
        eng.reconfigure(compile="sometimes")
    result = eng.reconfigure(compile="auto")            # auto compiles wherever the compiler runs
    assert result.applied == {"compile": "auto"} and eng.settings()["compile"] == "on (auto)"
    assert eng.runner.compiled is not None


def test_without_a_compiler_every_pass_is_eager_and_says_why(make_tiny_engine, monkeypatch):
    from engine.runtime import compiled_step
    monkeypatch.setattr(compiled_step, "compiler_refusal", lambda device_type: "no C++ compiler; install g++")
    eng = make_tiny_engine(compile="auto")
    assert eng.settings()["compile"] == "off: no C++ compiler; install g++" and eng.runner.compiled is None
    assert eng.generate_text([1, 2, 3, 4], SamplingParams(max_tokens=3, stop_on_eos=False))[1]


def test_every_pass_takes_one_graph(make_tiny_engine):
    """Prefill chunks, decodes, chain verifies and draft trees, alone and batched: after the
    first pass nothing compiles again (one graph, a dynamic token dimension)."""
    eng = make_tiny_engine(compile="on", proposer="ngram", num_speculative_tokens=3, max_num_batched_tokens=9)
    eng.warm_compiled_step()
    before = compiled_graphs()
    prompt = repeating_prompt(make_tiny_engine(compile="off"))
    eng.submit(prompt, GREEDY)
    eng.submit(list(range(7, 30)), GREEDY)
    while eng.has_work:
        assert all(e.compile_s == 0 for e in eng.step())
    eng.reconfigure(proposer="draft", draft_model="self:1", draft_tree="3:4:10")
    eng.generate_text(prompt, GREEDY)
    assert compiled_graphs() - before <= 1                 # the one-layer draft model's own graph
    assert len(eng.runner.compiled.row_counts) >= 5


def test_every_kv_dtype_takes_the_same_graph(make_tiny_engine):
    """Our C++ attention takes the pool as bytes (its width gives the dtype) and a float pool's
    unread scales shaped, strided and kinded like an FP8 pool's: switching the KV dtype, the pool
    rebuilt, compiles nothing."""
    eng = make_tiny_engine(compile="on")
    eng.warm_compiled_step()
    before = compiled_graphs()
    for kv in ("fp8_e4m3", "auto", "fp8_e4m3"):
        eng.reconfigure(kv_cache_dtype=kv)
        assert eng.generate_text([1, 2, 3, 4], GREEDY)[1]
    assert compiled_graphs() == before and eng.runner.attention_mode == "cpu"


def test_compiled_graphs_are_cached_in_the_user_cache_folder(make_tiny_engine, tmp_path, monkeypatch):
    """Importing torch._dynamo points inductor at torch's /tmp default; ours wins over that, in a
    folder of this version of the engine's sources (another version's graphs are never read)."""
    import os
    from pathlib import Path

    from engine.loading.loader import cache_dir
    from engine.runtime import compiled_step
    eng = make_tiny_engine(compile="on")
    eng.generate_text([1, 2, 3, 4], SamplingParams(max_tokens=3, stop_on_eos=False))
    tag = compiled_step.engine_source_tag()
    folder = cache_dir() / "inductor" / f"{tag}-{compiled_step.platform_tag()}"
    assert Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) == folder
    assert any((folder / "fxgraph").rglob("*"))
    # the tag follows the sources: a copy of the engine gives the same one, a changed byte another
    import shutil
    copy = tmp_path / "engine"
    shutil.copytree(Path(compiled_step.__file__).resolve().parents[1], copy,
                    ignore=shutil.ignore_patterns("__pycache__"))
    assert compiled_step.source_tag(copy) == tag
    (copy / "engine.py").write_text((copy / "engine.py").read_text() + "\n")
    assert compiled_step.source_tag(copy) != tag
    # and the platform: a graph cached under another ATen capability or forced kernel ISA is not read
    platform = compiled_step.platform_tag()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert compiled_step.platform_tag() != platform
    # a process started by this one inherits the folder: configured there, it chooses its own
    compiled_step.configure_compiler(cache_dir())
    assert Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) == cache_dir() / "inductor" / f"{tag}-{compiled_step.platform_tag()}"
    assert Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) != folder
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    compiled_step.configure_compiler(cache_dir())
    assert Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) == folder
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "chosen"))      # the user's own choice stays
    compiled_step.configure_compiler(cache_dir())
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "chosen")
    monkeypatch.setenv("WORKBENCH_CPU_ISA", "scalar")
    assert compiled_step.platform_tag() != platform


def test_compiling_is_reported_once_per_model(make_tiny_engine, tmp_path):
    """The app shows "compiling…" while the graph compiles: once per model, not per KV dtype,
    pool or token count."""
    from engine.loading.loader import load_model
    from engine.loading.synthetic import write_checkpoint
    from tests.conftest import engine_factory
    loaded = load_model(str(write_checkpoint(tmp_path, "tiny", seed=5)), dtype=torch.float32)
    eng = engine_factory(loaded, 8 * 2**20)(compile="on", proposer="ngram", num_speculative_tokens=2)
    messages = []
    eng.runner.compiled.progress = lambda message, fraction: messages.append((message.split(" ")[0], fraction))
    prompt = repeating_prompt(make_tiny_engine(compile="off"))
    eng.generate_text(prompt, GREEDY)
    assert messages == [("compiling", 0.0), ("compiled", 1.0)]
    eng.reconfigure(kv_cache_dtype="fp8_e4m3")                  # a new pool, the same graph
    eng.generate_text(prompt, GREEDY)
    assert messages == [("compiling", 0.0), ("compiled", 1.0)]


def test_a_failing_compiled_step_falls_back_to_eager_and_says_why(make_tiny_engine):
    """E.g. CUDA graph capture failing on a driver: the reply goes on eagerly, token for token
    what the eager path gives (fp32), and settings() (sent with the next event) names the reason."""
    prompt = repeating_prompt(make_tiny_engine(compile="off"))
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
    assert [e.settings["compile"] for e in events if e.settings] == [reason]     # the first pass failed
    eng.reconfigure(compile="off")
    eng.reconfigure(compile="on")                                     # stays off, and still says why
    assert eng.settings()["compile"] == reason
    assert make_tiny_engine(compile="on").runner.compiled is not None   # another engine's graph is intact


# ---- a compile is never timed as decoding ---------------------------------------------------
def test_a_step_that_compiles_is_marked_and_left_out_of_decode_speed(make_tiny_engine, tmp_path):
    from engine.loading.loader import load_model
    from engine.loading.synthetic import write_checkpoint
    from tests.conftest import engine_factory
    loaded = load_model(str(write_checkpoint(tmp_path, "tiny", seed=6)), dtype=torch.float32)
    eng = engine_factory(loaded, 8 * 2**20)(compile="on")
    eng.runner.compiled._compiled = _recompiling_once(eng.runner.compiled)
    events = list(eng.generate([1, 2, 3, 4], SamplingParams(max_tokens=6, stop_on_eos=False)))
    decode = [e for e in events if e.is_decode]
    assert events[0].compile_s > 0 and not events[0].is_decode     # the first pass (the prompt) compiled
    assert decode[0].compile_s > 0                        # the first decode step compiled again
    assert all(e.compile_s == 0 for e in decode[1:])       # and no other step did
    assert decode[0].as_dict()["step_tok_s"] is None       # a compiling step has no speed of its own
    summary = events[-1].summary
    assert summary.compile_s == decode[0].step_time_s and summary.compile_tokens == decode[0].num_tokens
    assert summary.compile_steps == 2 and [e.engine_step["compiles"] for e in events[:3]] == [1, 1, 0]
    timed = decode[1:]
    assert summary.decode_tok_s == pytest.approx(sum(e.num_tokens for e in timed) / sum(e.step_time_s for e in timed))
    assert summary.tpot_s == pytest.approx(summary.decode_time_s / (summary.generated_tokens - 1))  # wall time


def _recompiling_once(step):
    """The step's graph, with the second call counted as a recompile (as dynamo counts one)."""
    from torch._dynamo.utils import counters
    graph, calls = step._compiled, []

    def call(*args):
        calls.append(1)
        if len(calls) == 2:
            counters["stats"]["unique_graphs"] += 1
        return graph(*args)
    return call


def test_warming_compiles_now_so_that_no_reply_step_compiles(tmp_path):
    from engine.loading.loader import load_model
    from engine.loading.synthetic import write_checkpoint
    from tests.conftest import engine_factory
    loaded = load_model(str(write_checkpoint(tmp_path, "tiny", seed=7)), dtype=torch.float32)
    make = engine_factory(loaded, 8 * 2**20)
    eng = make(compile="on", enable_prefix_caching=True)
    messages = []
    eng.progress = eng.runner.progress = eng.runner.compiled.progress = lambda m, f: messages.append((m, f))
    assert eng.warm_compiled_step() > 0
    assert [f for _, f in messages] == [0.0, 1.0] and "compiling" in messages[0][0]
    assert eng.runner.blocks.num_used_blocks == 0 and eng.warm_compiled_step() == 0.0      # nothing left, once
    events = list(eng.generate([1, 2, 3, 4], SamplingParams(max_tokens=6, stop_on_eos=False)))
    assert all(e.compile_s == 0 for e in events) and events[-1].summary.compile_s == 0
    assert make(compile="off").warm_compiled_step() == 0.0        # eager: nothing to build
    assert make(compile="on").warm_compiled_step() == 0.0         # the model's graph is built: once


# ---- the thread governor's count changes never compile -------------------------------------
def test_a_thread_count_change_mid_reply_neither_compiles_nor_changes_a_token(make_tiny_engine):
    """Other programs take and free cores while a reply runs: the thread governor moves torch's
    thread count between its steps, and each step runs the graph built at load at the new count
    (the step's stats count no compile) and gives the tokens a steady count gives."""
    prompt = repeating_prompt(make_tiny_engine(compile="off"))
    eng = make_tiny_engine(compile="on", enable_prefix_caching=False)
    eng.warm_compiled_step()
    eng.thread_governor.tick = lambda: False                  # the test moves the count itself
    threads, built = torch.get_num_threads(), eng.runner.compiled.compiles
    _, expected, _ = eng.generate_text(prompt, GREEDY)
    eng.submit(prompt, GREEDY)
    events = []
    try:
        for count in [1, 2] * GREEDY.max_tokens:
            if not eng.has_work:
                break
            torch.set_num_threads(count)
            events += eng.step()
    finally:
        torch.set_num_threads(threads)
    assert [t for e in events for t in e.token_ids] == expected
    assert {e.engine_step["threads"] for e in events} == {1, 2}
    assert [e.engine_step["compiles"] for e in events] == [0] * len(events) and events[-1].summary.compile_steps == 0
    assert eng.runner.compiled.compiles == built


def test_other_global_state_than_the_graph_was_built_under_is_refused(make_tiny_engine):
    """The graph's guards leave dynamo's global-state check out (it includes the thread count);
    ours checks the rest: a graph is never run under state it was not built for."""
    eng = make_tiny_engine(compile="on")
    eng.warm_compiled_step()
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        assert eng.generate_text([1, 2, 3, 4], SamplingParams(max_tokens=2, stop_on_eos=False))[1]
    finally:
        torch.use_deterministic_algorithms(False)
    assert "other global torch state than it was built under (deterministic_algorithms" in eng.settings()["compile"]
    assert eng.runner.compiled is None                            # eager from then on, saying why


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
