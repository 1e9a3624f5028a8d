"""The EAGLE head's diagnosis (engine.training.diagnose) and the recipe's training-vs-held-out
report: the recall that bounds a tree must count exactly the drafts speculation accepts."""
import json

import pytest
import torch

from engine.metrics import PositionCounts, attempted_positions, ratio
from tests.conftest import serving_engine


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model):
    """The whole recipe on the tiny model with a head of its pinned tokens and 96 more (so some
    of the target's tokens fall outside it), and the answers it trained and was evaluated on."""
    from engine.loading.loader import load_eagle_head
    from engine.training.distill import Recipe, pinned_tokens, run
    from engine.training.served_data import dataset
    out, cache = tmp_path_factory.mktemp("eagle") / "tiny-eagle", tmp_path_factory.mktemp("data")
    recipe = Recipe(conversations=12, max_new_tokens=24, concurrency=12,
                    head_vocab=len(pinned_tokens(tiny_model.tokenizer)) + 96, steps=20,
                    batch_size=6, lr=3e-3, eval_every=10, depth=3)
    eng = serving_engine(tiny_model)
    report = run(recipe, out, threads=1, data_cache=cache, log=lambda m: None, engine=eng)
    train, held, _ = dataset(eng, recipe.conversations, recipe.seed, recipe.max_new_tokens,
                             recipe.concurrency, cache, log=lambda m: None)
    head, _ = load_eagle_head(str(out), tiny_model)
    return out, report, head, train, held


def test_the_report_puts_training_and_held_out_acceptance_side_by_side(trained):
    folder, report, *_ = trained
    saved = json.loads((folder / "distill_report.json").read_text())
    for point in saved["heldout_curve"]:
        assert 1 <= len(point["train_per_position"]) <= 4 and 1 <= len(point["per_position"]) <= 4
        assert point["train_mean_accepted_len"] >= 1.0 and point["mean_accepted_len"] >= 1.0
    assert 0.0 < saved["data"]["head_coverage_heldout"] < 1.0


def test_recall_grows_with_k_and_the_whole_head_recalls_every_token_inside_it(trained):
    from engine.training.diagnose import draft_ranks, head_slots, recall
    *_, head, train, held = trained
    size = len(head.head_token_ids)
    table = recall([draft_ranks(head, s, 4) for s in held], ks=(1, 2, 4, 8, size))
    ks = sorted(table)
    for d in range(4):
        for lo, hi in zip(ks, ks[1:]):
            assert table[lo]["any"][d] <= table[hi]["any"][d]
            assert table[lo]["reach"][d] <= table[hi]["reach"][d]
    for lo, hi in zip(ks, ks[1:]):
        assert table[lo]["tree_tau"] <= table[hi]["tree_tau"]
    for k in ks:
        assert table[k]["path"][0] == table[k]["any"][0] == table[k]["reach"][0]   # nothing before depth 1
        assert table[k]["tree_tau"] == pytest.approx(1 + sum(table[k]["reach"]))
    # with every head token allowed, depth d recalls exactly the labels x_{j+d+1} inside the head
    slots = head_slots(head)
    for d in range(1, 5):
        labels = [t for s in held for t in s.ids[len(s.prompt_ids) + d:]]
        assert table[size]["any"][d - 1] == pytest.approx(ratio(sum(int(slots[t]) >= 0 for t in labels), len(labels)))
    assert table[size]["any"][0] < 1.0                 # the crafted head misses some tokens


def test_depth1_recall_at_1_is_the_proposers_own_greedy_hit_rate(trained):
    """The recall's label pairing is the inference proposer's: from (f_j, x_{j+1}) it drafts
    x_{j+2}. Counted here with engine.speculative.eagle_proposer itself, position by position."""
    from engine.config import SamplingParams
    from engine.speculative.eagle_proposer import EagleProposer
    from engine.training.diagnose import draft_ranks, proposer_agreement, recall
    *_, head, train, held = trained
    hits = total = 0
    for s in held:
        proposer = EagleProposer(head, 16, torch.device("cpu"))
        proposer.target_pass(0, s.features.float())
        for j in range(len(s.prompt_ids) - 1, len(s.ids) - 2):
            hits += proposer.propose(s.ids[:j + 2], 1, SamplingParams(temperature=0.0), None).tokens == [s.ids[j + 2]]
            total += 1
    assert total > 100 and 0 < hits < total
    assert recall([draft_ranks(head, s, 1) for s in held], ks=(1,))[1]["any"][0] == pytest.approx(hits / total)
    assert proposer_agreement(head, held) == {"positions": total, "same_token": 1.0}


def test_greedy_speculation_replayed_from_the_ranks_is_evaluate(trained):
    """A draft token is accepted exactly when its rank is 0 along an all-accepted path: the
    k = 1 path recall counts the very drafts distill.evaluate accepts, at every depth."""
    from engine.training.diagnose import draft_ranks
    from engine.training.distill import evaluate
    *_, head, train, held = trained
    k = 4
    positions, tokens_out, passes = PositionCounts(), 0, 0
    for s in held + train:
        ranks = draft_ranks(head, s, k)
        j, first = len(s.prompt_ids) - 1, len(s.prompt_ids) - 1
        while j + 2 < len(s.ids):
            n = min(k, len(s.ids) - j - 2)
            m = 0
            while m < n and int(ranks[m, j - first]) == 0:
                m += 1
            positions.add(attempted_positions(m, n))
            tokens_out, passes = tokens_out + m + 1, passes + 1
            j += m + 1
    ev = evaluate(head, held + train, k)
    assert positions.rates() == pytest.approx(ev["per_position"])
    assert tokens_out / passes == pytest.approx(ev["mean_accepted_len"])
    assert ev["mean_accepted_len"] > 1.0               # some drafts were accepted


def test_training_stopped_at_a_checkpoint_resumes_to_the_same_head(trained, tiny_model, tmp_path):
    """A run stopped after its first evaluation and started again ends with the weights of a
    run that never stopped (the optimizer, schedule, data order and RNG are all saved)."""
    from engine.training.distill import Recipe, build_head, train
    *_, head, train_set, held = trained
    recipe = Recipe(conversations=12, max_new_tokens=24, concurrency=12, head_vocab=len(head.head_token_ids),
                    steps=12, batch_size=4, lr=3e-3, eval_every=6, depth=2)

    def fresh():
        torch.manual_seed(0)
        return build_head(tiny_model, head.head_token_ids.clone())

    whole = fresh()
    train(whole, train_set, held, recipe, log=lambda m: None)

    class Stop(Exception):
        pass

    def stop_after_first_eval(message):
        if "step 6:" in message:
            raise Stop
    checkpoint = tmp_path / "run.pt"
    with pytest.raises(Stop):
        train(fresh(), train_set, held, recipe, stop_after_first_eval, checkpoint)
    assert checkpoint.is_file()
    resumed, lines = fresh(), []
    train(resumed, train_set, held, recipe, lines.append, checkpoint)
    assert lines[0].startswith("  resumed at step 6")
    for (name, a), (_, b) in zip(whole.named_parameters(), resumed.named_parameters()):
        assert torch.equal(a, b), name
