"""The draft head's training data is the engine's own serving (engine.training.served_data): the
features a head trains on are, bit for bit, the ones the EAGLE proposer is handed when it
drafts, on the int4 default model; batched data is a request's own; shards resume."""
import pytest
import torch

from tests.conftest import chat, serving_engine

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Why is the sky blue?",
           "Give me three tips for learning to cook."]


def _proposer_features(monkeypatch):
    """Every row EagleProposer.target_pass is handed, by position (a later pass's rows win, as
    in the proposer's own buffer)."""
    from engine.speculative.eagle_proposer import EagleProposer
    seen: dict[int, torch.Tensor] = {}
    original = EagleProposer.target_pass

    def record(self, start, hidden):
        for i in range(hidden.shape[0]):
            seen[start + i] = hidden[i].clone()
        return original(self, start, hidden)
    monkeypatch.setattr(EagleProposer, "target_pass", record)
    return seen


def test_served_features_are_what_the_eagle_proposer_is_handed(default_model, make_engine, monkeypatch):
    """Training path and serving path on one prompt: the data's features (four requests at once,
    speculation off) against what the shipped head's proposer is handed while it drafts for
    that prompt alone (verify passes of k+1 rows among them)."""
    from engine import SamplingParams
    from engine.training.served_data import FEATURE_DTYPE, serve
    data, info = serve(serving_engine(default_model), [chat(p) for p in PROMPTS], 32, concurrency=4)
    assert info["answer_tokens"] == sum(len(s.answer_ids) for s in data)
    seen = _proposer_features(monkeypatch)
    eng = make_engine(proposer="eagle", num_speculative_tokens=4, enable_prefix_caching=False, compile="off")
    accepted = 0
    for s in data:
        seen.clear()
        _, out, stats = eng.generate_text(s.prompt_ids, SamplingParams(max_tokens=32))
        assert out == s.answer_ids                               # the same greedy answer
        assert stats.proposed > 0
        accepted += stats.accepted
        positions = len(s.prompt_ids) + len(s.answer_ids) - 1
        assert sorted(seen)[:positions] == list(range(positions))
        served = torch.stack([seen[j] for j in range(positions)])
        assert s.features.shape == served.shape
        assert torch.equal(s.features, served.to(FEATURE_DTYPE))     # bit for bit, as stored
    assert accepted > 0                          # verify passes kept drafted rows among them


def test_a_request_in_a_batch_gets_its_own_answer_and_features(tiny_model):
    from engine.training.served_data import serve
    convs = [chat(p) for p in PROMPTS]
    eng = serving_engine(tiny_model)
    alone = [serve(eng, [c], 16, concurrency=1)[0][0] for c in convs]
    together, _ = serve(eng, convs, 16, concurrency=4)
    for a, b in zip(alone, together):
        assert a.prompt_ids == b.prompt_ids and a.answer_ids == b.answer_ids
        assert torch.equal(a.features, b.features)
        assert a.features.shape[0] == len(a.ids) - 1


def test_files_are_reused_and_resume_where_they_stopped(tiny_model, tmp_path, monkeypatch):
    from engine.training import served_data
    convs = [chat(f"Tell me about the number {i}.") for i in range(5)]
    monkeypatch.setattr(served_data, "SHARD", 2)
    eng = serving_engine(tiny_model)
    first, info = served_data.served_dataset(eng, convs[:3], 8, 4, tmp_path, log=lambda m: None)
    assert len(list((tmp_path / "served").iterdir())) == 2          # [0, 1] and [2]
    served = []
    real = served_data.serve
    monkeypatch.setattr(served_data, "serve", lambda e, c, *a, **k: served.append(len(c)) or real(e, c, *a, **k))
    again, _ = served_data.served_dataset(eng, convs, 8, 4, tmp_path, log=lambda m: None)
    assert served == [2, 1]                  # [0, 1] read from disk; [2, 3] and [4] served
    assert [s.answer_ids for s in again[:2]] == [s.answer_ids for s in first[:2]]
    assert all(torch.equal(a.features, b.features) for a, b in zip(again[:2], first[:2]))


def test_the_data_refuses_what_would_leave_positions_without_features(tiny_model):
    from engine import EngineConfig
    from engine.engine import LLMEngine
    from engine.training.served_data import FeatureRecorder, serve
    eng = LLMEngine(tiny_model, EngineConfig(enable_prefix_caching=True, compile="off", kv_cache_bytes=8 * 2**20),
                    torch.device("cpu"))
    with pytest.raises(ValueError, match="prefix caching must be off"):
        serve(eng, [chat("Hi")], 4, 1)
    recorder = FeatureRecorder(8)
    recorder(0, 0, torch.zeros(3, 8))
    with pytest.raises(RuntimeError, match="started at position 5 but features end at 3"):
        recorder(0, 5, torch.zeros(1, 8))
