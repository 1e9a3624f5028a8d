"""LLMEngine on the embedded default model: chat, prefix cache, reconfigure, errors."""
import subprocess
import sys

import pytest

from engine import SamplingParams
from engine.errors import CacheTooSmallError, ConfigError, PromptTooLongError
from tests.conftest import chat

GREEDY = SamplingParams(max_tokens=24)


def test_answers_the_capital_of_france(make_engine):
    eng = make_engine()
    text, ids, stats = eng.generate_text(chat("What is the capital of France?"), GREEDY)
    assert "Paris" in text
    assert stats.generated_tokens == len(ids) and stats.ttft_s > 0


def test_events_stream_text_and_exact_cache_bytes(make_engine, still_governor):
    eng = make_engine()
    prompt = eng.encode(chat("Count from one to ten."))
    events = list(eng.generate(prompt, SamplingParams(max_tokens=8, stop_on_eos=False)))
    assert [len(e.token_ids) for e in events] == [1] * 8
    assert events[0].ttft_s is not None and all(e.ttft_s is None for e in events[1:])
    assert events[-1].finished and events[-1].finish_reason == "length"
    per_block = 16 * 46080                                  # fp32 SmolLM2: 46,080 bytes per token
    for i, e in enumerate(events):
        computed = len(prompt) + i                          # tokens with KV after step i
        assert e.kv_bytes_used == -(-computed // 16) * per_block
        assert e.kv_bytes_per_token == 46080
    assert "".join(e.text_delta for e in events) == eng.tokenizer.decode(
        [t for e in events for t in e.token_ids], skip_special_tokens=True)
    assert events[-1].running["generated_tokens"] == 8 and events[-1].running["decode_tokens"] == 7
    assert events[0].settings is not None and all(e.settings is None for e in events[1:])


def test_second_chat_turn_hits_the_first_turns_blocks(make_engine):
    eng = make_engine()
    held = []
    original_end = eng.runner.end
    eng.runner.end = lambda seq: (held.append(list(seq.block_table)), original_end(seq))
    turn1 = chat("Name three colours.", system="You are terse.")
    answer, _, s1 = eng.generate_text(turn1, GREEDY)
    turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And three fruits?"}]
    _, _, s2 = eng.generate_text(turn2, GREEDY)
    first_prompt_blocks = (s1.prompt_tokens - 1) // 16
    assert s1.prefix_hit_tokens == 0
    assert s2.prefix_hit_tokens >= first_prompt_blocks * 16
    hit_blocks = s2.prefix_hit_tokens // 16
    assert held[1][:hit_blocks] == held[0][:hit_blocks]     # the very same physical blocks


def test_prefix_cache_off_and_fp8_toggle_never_reuse(make_engine):
    eng = make_engine()
    msgs = chat("Tell me about the moon. " * 8)
    eng.generate_text(msgs, SamplingParams(max_tokens=2))
    assert eng.generate_text(msgs, SamplingParams(max_tokens=2))[2].prefix_hit_tokens > 0
    eng.reconfigure(enable_prefix_caching=False)
    assert eng.generate_text(msgs, SamplingParams(max_tokens=2))[2].prefix_hit_tokens == 0
    eng.reconfigure(enable_prefix_caching=True, kv_cache_dtype="fp8_e4m3")
    _, _, s = eng.generate_text(msgs, SamplingParams(max_tokens=2))
    assert s.prefix_hit_tokens == 0                         # blocks of the other dtype are never served
    assert eng.settings()["kv_cache_dtype"] == "fp8_e4m3"
    assert eng.generate_text(msgs, SamplingParams(max_tokens=2))[2].prefix_hit_tokens > 0


def test_fp8_cache_keeps_the_answer(make_engine):
    eng = make_engine(kv_cache_dtype="fp8_e4m3")
    text, _, _ = eng.generate_text(chat("What is the capital of France?"), GREEDY)
    assert "Paris" in text


def test_reconfigure_while_running_defers_pool_changes(make_engine, still_governor):
    eng = make_engine()
    gen = eng.generate(chat("Write a long poem."), SamplingParams(max_tokens=6, stop_on_eos=False))
    first = next(gen)
    result = eng.reconfigure(kv_cache_dtype="fp8_e4m3", proposer="ngram")
    assert result.deferred == {"kv_cache_dtype": "fp8_e4m3"} and result.applied == {"proposer": "ngram"}
    rest = list(gen)
    assert first.kv_dtype == "float32" and all(e.kv_dtype == "float32" for e in rest)
    changes = [e.settings for e in rest if e.settings is not None]
    assert len(changes) == 1 and changes[0]["proposer"] == "ngram"     # sent once, when it changed
    assert first.settings["proposer"] == "off"                           # the first event has them all
    assert eng.settings()["kv_cache_dtype"] == "fp8_e4m3"   # applied once the request ended


def test_cancel_stops_within_one_step_and_is_not_a_target_pass(make_engine):
    eng = make_engine()
    gen = eng.generate(chat("Write a long story."), SamplingParams(max_tokens=200, stop_on_eos=False))
    next(gen), next(gen), next(gen)
    eng.cancel()
    events = list(gen)
    assert len(events) == 1 and events[0].finish_reason == "cancelled"
    assert events[0].token_ids == [] and events[0].target_passes == 0
    summary = events[0].summary
    assert (summary.decode_tokens, summary.target_passes, summary.mean_accepted_len) == (2, 2, 1.0)
    assert eng.runner.blocks.num_used_blocks == 0           # blocks released


def test_a_request_advances_one_step_per_call(make_engine):
    eng = make_engine()
    request = eng.start(chat("Count to five."), SamplingParams(max_tokens=3, stop_on_eos=False))
    assert eng.has_work and eng.runner.blocks.num_used_blocks == 0       # blocks come with its first step
    steps = [request.step() for _ in range(3)]
    assert [e.step for e in steps] == [0, 1, 2] and request.finished and steps[-1].finish_reason == "length"
    assert all(e.request_id == request.request_id for e in steps)
    request.close()
    assert eng.runner.blocks.num_used_blocks == 0 and not eng.has_work


def test_two_streams_share_the_engine_steps(make_engine):
    eng = make_engine()
    first = eng.start(chat("Count to five."), SamplingParams(max_tokens=4, stop_on_eos=False))
    second = eng.start(chat("Name a colour."), SamplingParams(max_tokens=4, stop_on_eos=False))
    first.step()
    assert second.request.events                   # the same engine step advanced both
    while not first.finished:
        first.step()
    second.close()                                 # cancels it and frees its blocks
    assert eng.runner.blocks.num_used_blocks == 0 and not eng.has_work


def test_an_empty_proposal_keeps_its_draft_time(make_engine, monkeypatch):
    from engine.speculative.spec_decode import NgramProposer, Proposal
    from engine.speculative.tree import DraftTree
    monkeypatch.setattr(NgramProposer, "propose", lambda self, *a: Proposal(DraftTree.chain([]), None, time_s=0.25))
    eng = make_engine(proposer="ngram", speculation_policy="fixed")
    _, _, stats = eng.generate_text(chat("Hi"), SamplingParams(max_tokens=4, stop_on_eos=False))
    assert stats.draft_time_s == pytest.approx(0.5)      # two decode steps tried to draft and stats.proposed == 0


def test_prompt_longer_than_context(make_engine):
    eng = make_engine(max_model_len=64)
    with pytest.raises(PromptTooLongError, match="prompt has 1.. tokens but the context holds 64"):
        list(eng.generate("word " * 150))


def test_cache_too_small_for_the_request_keeps_the_engine_usable(make_engine):
    eng = make_engine(num_blocks=4)
    with pytest.raises(CacheTooSmallError, match="needs .* KV blocks"):
        list(eng.generate(chat("hello " * 60), SamplingParams(max_tokens=4)))
    assert eng.runner.blocks.num_free_blocks == 4
    text, _, _ = eng.generate_text("Hi", SamplingParams(max_tokens=4))
    assert text


def test_bad_settings_are_refused_and_change_nothing(make_engine):
    eng = make_engine()
    before = eng.settings()
    with pytest.raises(ConfigError, match="k .* must be in 1..16"):
        eng.reconfigure(num_speculative_tokens=40)
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        eng.reconfigure(kv_cache_dtype="int3")
    with pytest.raises(ConfigError, match="'dtype' cannot change on a loaded engine"):
        eng.reconfigure(dtype="bfloat16", proposer="ngram")
    assert eng.settings() == before


def test_engine_imports_without_qt():
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('PySide6', 'pyqtgraph', 'PyQt5', 'PyQt6'):\n"
            "            raise ImportError('Qt is blocked in this test')\n"
            "sys.meta_path.insert(0, Block())\n"
            "import engine, engine.engine, engine.bench.scenarios, engine.speculative.spec_decode, engine.profiles\n"
            "assert not any(m.startswith(('PySide6', 'pyqtgraph')) for m in sys.modules)\n")
    subprocess.run([sys.executable, "-c", code], check=True)
