"""Many requests at once (engine.scheduler): a request's tokens never depend on what else the
engine is doing. Eight concurrent requests of mixed lengths each give exactly their solo
tokens, greedy and seeded-sampled, in fp32 and bf16, with a preemption, a prefix-cache hit
and a chunked prefill among them, and with each proposer on. Plus the scheduler's rules,
the step API, cancels, and blocks coming back."""
import random

import pytest
import torch

from engine import EngineConfig, SamplingParams
from engine.engine import LLMEngine
from engine.errors import CacheTooSmallError, PromptTooLongError
from tests.conftest import chat, forced_fallback

SHARED = list(range(3000, 3064))            # a 64-token prefix two prompts share (a prefix-cache hit)


QUESTION = chat("What is the capital of France?")     # the tiny model soon loops on it: n-gram drafts


def prompts(loaded) -> list[list[int]]:
    """Eight prompts of mixed lengths (5..150 tokens); the first two share SHARED."""
    rng = random.Random(7)
    out = [SHARED + [rng.randrange(100, 40000) for _ in range(150 - len(SHARED))],
           SHARED + [rng.randrange(100, 40000) for _ in range(20)], engine(loaded).encode(QUESTION)]
    return out + [[rng.randrange(100, 40000) for _ in range(n)] for n in (5, 37, 90, 12, 23)]


MAX_TOKENS = [10, 14, 30, 8, 20, 12, 26, 16]


def params_for(i: int, sampled: bool) -> SamplingParams:
    """Greedy, or seeded sampling. Sampled, the random tiny model never repeats itself (no
    n-gram drafts), except the question's request whose top-1 sampling loops (the rejection
    sampler still runs: its target distribution is a point mass)."""
    if sampled:
        return SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0.7, top_k=1 if i == 2 else 5, top_p=0.95,
                              seed=100 + i, stop_on_eos=False)
    return SamplingParams(max_tokens=MAX_TOKENS[i], stop_on_eos=False)


# Every pass runs through the compiled step (compile on) or the eager reference (off), never a
# mix of the two: invariance must hold on each, in fp32 and in bf16 (the CPU's default dtype).
@pytest.fixture(scope="module", params=[(torch.float32, "off"), (torch.bfloat16, "off"), (torch.float32, "on"),
                                        (torch.bfloat16, "on")], ids=["fp32", "bf16", "fp32-compiled", "bf16-compiled"])
def tiny(request, tmp_path_factory):
    from engine.loading.loader import load_model
    from engine.loading.synthetic import write_checkpoint
    dtype, compile_mode = request.param
    folder = write_checkpoint(tmp_path_factory.mktemp("tiny-batch"), "tiny", seed=0)
    loaded = load_model(str(folder), dtype=dtype)
    COMPILE[id(loaded)] = compile_mode
    return loaded


COMPILE: dict[int, str] = {}         # the compile setting each loaded model's engines take


# Each linear kernel a CPU may take (conftest.FALLBACKS), forced: batch invariance must hold on
# whichever was chosen. (The plain fp32 and bf16 paths are the `tiny` fixture's.)
FALLBACK_PATHS = {"fp32-ours-refused": (torch.float32, "ours-refused"), "fp32-row-tiles": (torch.float32, "row-tiles"),
                  "bf16-onednn-refused": (torch.bfloat16, "onednn-refused"),
                  "bf16-both-refused": (torch.bfloat16, "both-refused"), "fp32-avx2": (torch.float32, "avx2"),
                  "bf16-avx2": (torch.bfloat16, "avx2"),
                  # our quantized linear's 256-bit paths, its weights int4 at load (row groups of 4, a
                  # decoded tile reused past 4 rows): AVX2, and the AVX-VNNI code in AVX-512 VL's form
                  "bf16-int4-quant-avx2": (torch.bfloat16, "quant-avx2", "int4"),
                  "fp32-int4-quant-vnni256": (torch.float32, "quant-vnni256", "int4")}


@pytest.fixture(scope="module", params=list(FALLBACK_PATHS))
def tiny_fallback(request, tmp_path_factory):
    from engine.loading.loader import load_model
    from engine.loading.synthetic import write_checkpoint
    dtype, fallback, *weights = FALLBACK_PATHS[request.param]
    folder = write_checkpoint(tmp_path_factory.mktemp("tiny-fallback"), "tiny", seed=0)
    with forced_fallback(fallback):
        yield load_model(str(folder), dtype=dtype, weight_dtype=weights[0] if weights else "auto")


def engine(loaded, **config) -> LLMEngine:
    config.setdefault("kv_cache_bytes", 8 * 2**20)
    config.setdefault("compile", COMPILE.get(id(loaded), "off"))
    return LLMEngine(loaded, EngineConfig(**config), torch.device("cpu"))


def solo(loaded, prompt, params, **config) -> list[int]:
    return engine(loaded, **config).generate_text(prompt, params)[1]


def run_together(eng: LLMEngine, all_prompts, all_params) -> tuple[dict, dict]:
    """The first request alone until its prompt is in the cache, then the rest at once."""
    ids = [eng.submit(all_prompts[0], all_params[0])]
    tokens, stats = {ids[0]: []}, {}
    while not any(e.request_id == ids[0] for e in _drain(eng, tokens, stats, once=True)):
        pass
    for p, s in zip(all_prompts[1:], all_params[1:]):
        rid = eng.submit(p, s)
        ids.append(rid)
        tokens[rid] = []
    _drain(eng, tokens, stats)
    return {i: tokens[rid] for i, rid in enumerate(ids)}, {i: stats[rid] for i, rid in enumerate(ids)}


def _drain(eng, tokens, stats, once=False):
    events = []
    while eng.has_work:
        step = eng.step()
        for e in step:
            tokens[e.request_id].extend(e.token_ids)
            if e.finished:
                stats[e.request_id] = e.summary
        events += step
        if once:
            break
    return events


# ---- batch invariance ----------------------------------------------------------------------
# A pool of 12 blocks of 16 tokens (the eight need 35 at their longest) forces preemptions; a
# 48-token budget chunks the prefills.
PRESSURE = dict(num_blocks=12, block_size=16, max_num_batched_tokens=48)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_eight_concurrent_requests_give_their_solo_tokens(tiny, sampled):
    _eight_concurrent(tiny, sampled)


def _eight_concurrent(tiny, sampled, **config):
    all_prompts = prompts(tiny)
    all_params = [params_for(i, sampled) for i in range(8)]
    alone = [solo(tiny, p, s, **config) for p, s in zip(all_prompts, all_params)]
    eng = engine(tiny, **PRESSURE, **config)
    together, stats = run_together(eng, all_prompts, all_params)
    if COMPILE.get(id(tiny)) == "on":              # every pass of every request ran compiled
        assert eng.runner.compiled is not None and len(eng.runner.compiled.row_counts) > 3
    assert [together[i] for i in range(8)] == alone
    assert sum(s.preemptions for s in stats.values()) >= 1                 # one was preempted
    assert stats[1].prefix_hit_tokens == 64                                # its shared prefix came from the cache
    assert len(all_prompts[0]) > PRESSURE["max_num_batched_tokens"]        # its prefill was chunked


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_on_every_fallback_kernel_concurrent_requests_give_their_solo_tokens(tiny_fallback, sampled):
    _eight_concurrent(tiny_fallback, sampled)


@pytest.mark.parametrize("fallback", ["attention-refused", "attention-scalar", "fp8-refused"])
def test_the_compiled_step_on_each_attention_fallback_gives_solo_tokens(tmp_path, fallback):
    """The compiled step with the torch attention path (our CPU kernel refused) or the
    kernel's baseline build, bf16, with an FP8 cache: invariance holds on each."""
    from engine.loading.loader import load_model
    from engine.loading.synthetic import write_checkpoint
    with forced_fallback(fallback):
        loaded = load_model(str(write_checkpoint(tmp_path, "tiny", seed=0)), dtype=torch.bfloat16)
        COMPILE[id(loaded)] = "on"
        try:
            _eight_concurrent(loaded, False, kv_cache_dtype="fp8_e4m3")
        finally:                                   # its id may be another model's once it is freed
            del COMPILE[id(loaded)]


@pytest.mark.parametrize("proposer,extra", [("ngram", {}), ("draft", {"draft_model": "self:1"})])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_the_same_holds_with_each_proposer_on(tiny, proposer, extra, sampled):
    # Seeded sampling under speculation is lossless in distribution, not in draws: its tokens
    # depend on how many drafts each step verified, so it is compared at a fixed k.
    spec = dict(proposer=proposer, num_speculative_tokens=3, speculation_policy="fixed" if sampled else "auto", **extra)
    all_prompts = prompts(tiny)
    all_params = [params_for(i, sampled) for i in range(8)]
    alone = [solo(tiny, p, s, **spec) for p, s in zip(all_prompts, all_params)]
    together, stats = run_together(engine(tiny, **PRESSURE, **spec), all_prompts, all_params)
    assert [together[i] for i in range(8)] == alone
    assert sum(s.proposed for s in stats.values()) > 0
    if not sampled:      # greedy speculation is token-identical to plain decoding
        assert alone == [solo(tiny, p, s) for p, s in zip(all_prompts, all_params)]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_the_same_holds_with_an_fp8_cache(tiny, sampled):
    _eight_concurrent(tiny, sampled, kv_cache_dtype="fp8_e4m3")


def test_the_same_holds_with_draft_trees(tiny):
    """Greedy draft trees (a draft model's, shape 3:4:10): each request's tokens alone, together
    and without speculation are the same, with a preemption among them."""
    spec = dict(proposer="draft", draft_model="self:1", num_speculative_tokens=3, draft_tree="3:4:10")
    all_prompts = prompts(tiny)
    all_params = [params_for(i, False) for i in range(8)]
    alone = [solo(tiny, p, s, **spec) for p, s in zip(all_prompts, all_params)]
    together, stats = run_together(engine(tiny, **PRESSURE, **spec), all_prompts, all_params)
    assert [together[i] for i in range(8)] == alone
    assert sum(s.preemptions for s in stats.values()) >= 1
    assert sum(s.proposed for s in stats.values()) > 0
    assert alone == [solo(tiny, p, s) for p, s in zip(all_prompts, all_params)]


def test_a_prefix_hit_and_a_chunk_boundary_change_nothing(tiny):
    prompt = prompts(tiny)[0]
    params = SamplingParams(max_tokens=12, stop_on_eos=False)
    cold = solo(tiny, prompt, params, enable_prefix_caching=False)
    eng = engine(tiny, max_num_batched_tokens=7)                # chunks of 7: boundaries inside blocks
    assert eng.generate_text(prompt, params)[1] == cold
    again = eng.generate_text(prompt, params)                   # served from the prefix cache
    assert again[2].prefix_hit_tokens == 144 and again[1] == cold


# ---- the scheduler's rules -------------------------------------------------------------
def test_decodes_go_first_and_a_long_prompt_is_chunked(tiny):
    eng = engine(tiny, max_num_batched_tokens=16)
    short = eng.submit(list(range(200, 210)), SamplingParams(max_tokens=20, stop_on_eos=False))
    eng.step()                                                  # its prompt (10 tokens) and first token
    long = eng.submit(list(range(500, 560)), SamplingParams(max_tokens=4, stop_on_eos=False))
    seen = []
    while eng.has_work and len(seen) < 4:
        step = eng.step()
        seen.append({e.request_id for e in step})
        assert eng.last_step.prefill_tokens + eng.last_step.decode_tokens <= 16
    # The short request decoded in every step while the 60-token prompt went in 15-token chunks.
    assert all(short in ids for ids in seen)
    assert [long in ids for ids in seen] == [False, False, False, True]


def test_the_newest_request_is_preempted_and_resumes_from_the_cache(tiny):
    eng = engine(tiny, num_blocks=6, block_size=16)             # 96 tokens in all
    eng.submit(list(range(100, 140)), SamplingParams(max_tokens=30, stop_on_eos=False))     # the older one
    b = eng.submit(list(range(300, 340)), SamplingParams(max_tokens=30, stop_on_eos=False))
    preempted, first_preemption = set(), None
    while eng.has_work:
        for e in eng.step():
            if e.finished:
                preempted |= {e.request_id} if e.summary.preemptions else set()
        if eng.last_step.preemptions and first_preemption is None:
            first_preemption = eng.last_step
    assert preempted == {b}                                     # the newer one, never the older
    assert first_preemption.waiting == 1
    assert eng.runner.blocks.num_free_blocks == 6


def test_max_num_seqs_caps_the_running_requests(tiny):
    eng = engine(tiny, max_num_seqs=3)
    for i in range(5):
        eng.submit(list(range(100 + i, 110 + i)), SamplingParams(max_tokens=5, stop_on_eos=False))
    eng.step()
    assert (eng.last_step.running, eng.last_step.waiting) == (3, 2)


def test_step_events_carry_request_ids_and_step_figures(tiny):
    eng = engine(tiny)
    ids = [eng.submit(list(range(100 + 9 * i, 108 + 9 * i)), SamplingParams(max_tokens=3, stop_on_eos=False))
           for i in range(3)]
    events = eng.step()
    assert sorted(e.request_id for e in events) == ids
    step = events[0].engine_step
    assert step["batch_size"] == 3 and step["prefill_tokens"] == 24 and step["decode_tokens"] == 0
    assert step["kv_blocks_used"] == 3 and step["running"] == 3 and step["waiting"] == 0
    while eng.has_work:
        last = eng.step()
    done = last[0].summary
    assert done.queue_time_s is not None and done.e2e_s >= done.ttft_s
    assert len(done.itl_s) == 2 and done.tpot_s == pytest.approx(sum(done.itl_s) / 2)


def test_cancel_any_request_any_time_and_every_block_comes_back(tiny):
    """200 requests with cancels (waiting, mid-prefill, decoding) and preemptions: afterwards
    the pool's free block count is what it was at the start."""
    eng = engine(tiny, num_blocks=24, block_size=8, max_num_batched_tokens=40, max_num_seqs=12)
    start = eng.runner.blocks.num_free_blocks
    rng = random.Random(3)
    submitted, finished, preemptions = [], {}, 0
    for i in range(200):
        prompt = [rng.randrange(100, 40000) for _ in range(rng.randrange(3, 60))]
        submitted.append(eng.submit(prompt, SamplingParams(max_tokens=rng.randrange(1, 25), stop_on_eos=False)))
        if rng.random() < 0.3:
            eng.cancel(rng.choice(submitted))
        for _ in range(rng.randrange(0, 3)):
            for e in eng.step():
                if e.finished:
                    finished[e.request_id] = e.finish_reason
            preemptions += eng.last_step.preemptions if eng.last_step else 0
    while eng.has_work:
        for e in eng.step():
            if e.finished:
                finished[e.request_id] = e.finish_reason
        preemptions += eng.last_step.preemptions
    assert sorted(finished) == sorted(submitted)
    assert "cancelled" in finished.values() and preemptions > 0
    assert eng.runner.blocks.num_free_blocks == start
    assert all(b.ref_count == 0 for b in eng.runner.blocks.blocks)


def test_bad_requests_are_refused_at_submit_and_queue_nothing(tiny):
    eng = engine(tiny, num_blocks=4, block_size=16)
    with pytest.raises(CacheTooSmallError, match="needs 5 KV blocks"):
        eng.submit(list(range(100, 150)), SamplingParams(max_tokens=30))
    with pytest.raises(PromptTooLongError):
        eng.submit(list(range(eng.max_model_len + 1)))
    assert not eng.has_work and eng.requests == {}


# ---- the default model ----------------------------------------------------------------
@pytest.mark.slow
def test_default_model_batched_replies_equal_solo_replies():
    """In the dtype the app defaults to on this CPU (dtype auto)."""
    from engine.engine import pick_dtype
    from engine.loading.loader import load_model
    cpu = torch.device("cpu")
    loaded = load_model("default", dtype=pick_dtype("auto", cpu)[0])
    eng = LLMEngine(loaded, EngineConfig(kv_cache_bytes=64 * 2**20), cpu)
    questions = ["What is the capital of France?", "Name three colours.", "Write a haiku about the sea.",
                 "Why is the sky blue?"]
    params = SamplingParams(max_tokens=16)
    alone = [eng.generate_text(chat(q), params)[1] for q in questions]
    eng.reset_prefix_cache()
    ids = [eng.submit(chat(q), params) for q in questions]
    got = {rid: [] for rid in ids}
    while eng.has_work:
        for e in eng.step():
            got[e.request_id].extend(e.token_ids)
    assert [got[rid] for rid in ids] == alone


# ---- the speculation policy ------------------------------------------------------------
def test_the_policy_speculates_alone_and_stops_when_a_wide_pass_costs_more_than_it_gains():
    from engine.speculative.policy import SpeculationPolicy
    policy = SpeculationPolicy()
    assert policy.choose_k("ngram", batch=1, k_max=4) == 4            # nothing measured yet: try k
    for _ in range(5):
        policy.record_pass(rows=1, seconds=0.020)
        policy.record_pass(rows=5, seconds=0.021)                      # a verify pass costs a decode step
        policy.record_pass(rows=16, seconds=0.040)
        policy.record_pass(rows=80, seconds=0.160)
        policy.record_verdict("ngram", [True, True, True, False])
    assert policy.alpha("ngram") == pytest.approx(0.75)
    assert policy.predicted_pass_s(48) == pytest.approx(0.100)         # between the measured widths
    assert policy.choose_k("ngram", batch=1, k_max=4) == 4             # 5 rows cost what 1 row costs
    assert policy.choose_k("ngram", batch=16, k_max=4) == 0            # 16 * tau(0.75, 4) / 0.16 < 16 / 0.04
    assert policy.choose_k("ngram", batch=32, k_max=4) == 4            # 160 rows never measured: tried once
    for _ in range(5):
        policy.record_draft(tokens=4, seconds=0.080)                   # a draft model as slow as the target
    assert policy.choose_k("ngram", batch=1, k_max=4) == 0
