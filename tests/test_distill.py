"""The draft distillation recipe (engine.distill) and the shipped draft it made."""
import json

import pytest
import torch

from engine import SamplingParams
from engine.spec_decode import check_draft_compatible
from tests.conftest import chat

SHIPPED = pytest.importorskip("engine.loader").SHIPPED_DRAFT_FOLDER


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread: on a shared, busy CPU, intra-op threads waiting on each other make
    these runs many times slower, and one thread keeps the tiny training bit-reproducible."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _greedy_ids(engine, prompt, proposer, tokens=24):
    engine.reconfigure(proposer=proposer, num_speculative_tokens=4)
    _, ids, stats = engine.generate_text(engine.encode(prompt), SamplingParams(max_tokens=tokens, stop_on_eos=False))
    return ids, stats


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory, default_model):
    """The whole pipeline on a tiny budget: generate, choose the head, train, save, evaluate."""
    from engine.distill import DRAFT_FOLDER_NAME, Recipe, run
    resources = tmp_path_factory.mktemp("resources")
    recipe = Recipe(layers=[0, 29], head_vocab=512, train_prompts=4, heldout_prompts=2, max_new_tokens=8,
                    gen_batch_size=4, steps=3, batch_size=2)
    report = run(recipe, resources / "drafts" / DRAFT_FOLDER_NAME, log=lambda m: None, target=default_model)
    return resources, report


def test_tiny_distill_writes_a_compatible_draft_with_its_recipe(tiny_draft, default_model):
    from engine.distill import DRAFT_FOLDER_NAME
    from engine.loader import load_draft_folder
    resources, report = tiny_draft
    folder = resources / "drafts" / DRAFT_FOLDER_NAME
    saved = json.loads((folder / "distill_report.json").read_text())
    assert saved["recipe"]["seed"] == 0 and saved["steps_done"] == 3
    # Rates for the positions the simulated speculation reached (a position is tried only
    # after every earlier draft token was accepted), at most k = 4 of them.
    per_position = saved["heldout"]["per_position"]
    assert saved["heldout"]["eval_tokens"] > 0 and 1 <= len(per_position) <= 4
    assert all(0.0 <= rate <= 1.0 for rate in per_position)
    draft = load_draft_folder(folder, default_model)
    check_draft_compatible(default_model.tokenizer, draft.tokenizer)
    assert draft.hf_config.model_type == "llama" and len(draft.model.layers) == 2
    assert draft.model.embed_tokens is default_model.model.embed_tokens      # shared, not stored
    assert not any("embed" in k for k in _stored_names(folder))


def test_greedy_speculation_with_a_distilled_draft_matches_the_target(tiny_draft, make_engine, monkeypatch):
    from engine import loader
    resources, _ = tiny_draft
    from engine.distill import DRAFT_FOLDER_NAME
    monkeypatch.setattr(loader, "SHIPPED_DRAFT_FOLDER", resources / "drafts" / DRAFT_FOLDER_NAME)   # "default-draft" -> the tiny draft
    engine = make_engine()
    engine.set_draft_model(loader.DEFAULT_DRAFT)
    prompt = chat("Write a haiku about the sea.")
    target_only, _ = _greedy_ids(engine, prompt, "off")
    speculative, stats = _greedy_ids(engine, prompt, "draft")
    assert stats.proposed > 0
    assert speculative == target_only


@pytest.mark.skipif(not (SHIPPED / "config.json").is_file(), reason="no draft shipped in resources/drafts")
def test_shipped_draft_loads_as_default_draft_and_stays_lossless(make_engine, default_model):
    from engine.loader import DEFAULT_DRAFT
    engine = make_engine()
    engine.set_draft_model(DEFAULT_DRAFT)
    draft = engine.draft_runner.loaded
    assert len(draft.model.layers) < len(default_model.model.layers)
    report = json.loads((SHIPPED / "distill_report.json").read_text())
    assert {"recipe", "heldout", "steps_done", "data"} <= set(report)
    assert sum(f.stat().st_size for f in SHIPPED.iterdir()) <= 40 * 2**20
    prompt = chat("Why is the sky blue?")
    target_only, _ = _greedy_ids(engine, prompt, "off", tokens=16)
    speculative, stats = _greedy_ids(engine, prompt, "draft", tokens=16)
    assert speculative == target_only
    assert stats.accepted > 0          # a trained draft gets some tokens accepted on a chat prompt


def _stored_names(folder):
    from safetensors import safe_open
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return list(f.keys())
