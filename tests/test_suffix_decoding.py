"""The suffix proposer (engine.speculative.suffix_proposer) and its index (engine.speculative.suffix_index):
exact matches and counts, the global index's bound and eviction, the probability floor and
the length rule, no draft without a match; and in the engine: greedy output token-identical
alone and batched, branching trees included, and sampled output with the target's
distribution."""
import math

import pytest
import torch

from engine import SamplingParams
from engine.speculative.suffix_index import SuffixIndex
from engine.speculative.suffix_proposer import GLOBAL, REQUEST, SuffixCache, SuffixProposer, best_draft, continuation_tree
from tests.conftest import assert_second_token_follows_the_target, chat, together

GREEDY = SamplingParams(max_tokens=24, stop_on_eos=False)
TEXT = [1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3]


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # conftest: the module on one thread


def _propose(proposer, token_ids, k=8):
    return proposer.propose(list(token_ids), k, GREEDY, None)


# ---- the index ------------------------------------------------------------------------------
def test_match_finds_every_occurrence_with_its_exact_length():
    index = SuffixIndex()
    index.extend(TEXT)
    match = index.match(TEXT, before=index.end - 1)          # the context's own last position left out
    assert match.positions == [2, 6]                        # "... 2 3" ends at 2 (after "1 2 3") and at 6
    assert match.lengths == [3, 2]                          # "1 2 3" matches 3 tokens, "9 2 3" only "2 3"
    assert index.following(match.positions, 3) == [[4, 9, 2], [5, 6, 1]]
    assert index.following([10], 3) == [[3]]                # the text ends
    assert len(index.match([7, 8])) == 0                    # never seen
    only_last = index.match([7, 4])                         # the pair is new: its last token alone
    assert (only_last.positions, only_last.lengths) == ([3], [1])


def test_matches_and_continuations_stop_at_document_boundaries():
    index = SuffixIndex()
    index.add_document([5, 6, 7])
    index.add_document([8, 9])
    assert index.match([7, 8]).positions == [4]             # 8 occurs, but after the boundary...
    assert index.match([7, 8]).lengths == [1]               # ...so "7 8" is not matched as a pair
    assert index.match([6, 7, 8]).lengths == [1]
    assert index.following([1], 4) == [[7]]                 # the first document ends


def test_continuation_counts_are_path_counts_over_occurrences():
    windows = [[5, 6, 7], [5, 6, 8], [5, 6, 7], [9]]
    tree, score = continuation_tree(windows, 8, 0.1)
    probs = [round(math.exp(s), 6) for s in tree.scores]
    paths = [tuple(tree.tokens[i] for i in tree.path(n)) for n in range(len(tree))]
    assert dict(zip(paths, probs)) == {(5,): 0.75, (5, 6): 0.75, (5, 6, 7): 0.5, (9,): 0.25, (5, 6, 8): 0.25}
    assert paths[:3] == [(5,), (5, 6), (5, 6, 7)]             # most probable first, a parent before its child
    assert score == pytest.approx(0.75 + 0.75 + 0.5 + 0.25 + 0.25)
    small, small_score = continuation_tree(windows, 3, 0.1)      # the best 3 nodes: a chain
    assert small.tokens == [5, 6, 7] and small.is_chain() and small_score == pytest.approx(2.0)


def test_the_probability_floor_drops_rare_continuations():
    windows = [[5, 6]] * 9 + [[7, 8]]                          # 7 followed one occurrence in ten
    kept, _ = continuation_tree(windows, 8, 0.1)
    assert sorted(kept.tokens) == [5, 6, 7, 8]                  # 0.1 is at the floor: kept
    dropped, _ = continuation_tree(windows, 8, 0.11)
    assert dropped.tokens == [5, 6]


def test_the_draft_length_follows_the_match_length():
    index = SuffixIndex()
    index.extend([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0, 3, 4])
    context = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0, 3, 4]
    match = index.match(context, before=index.end - 1)
    assert match.lengths == [2]                                   # "3 4" matched
    assert best_draft(index, match, 8, 1.0, 0.1)[0].tokens == [5, 6]       # 1.0 x 2 tokens
    assert best_draft(index, match, 8, 2.5, 0.1)[0].tokens == [5, 6, 7, 8, 9]   # 2.5 x 2
    assert best_draft(index, match, 3, 2.5, 0.1)[0].tokens == [5, 6, 7]    # never more than k
    assert best_draft(index, match, 8, 0.4, 0.1) is None                   # 0.4 x 2 < 1 token


def test_the_global_index_keeps_its_token_bound_evicting_the_oldest_requests():
    index = SuffixIndex(max_tokens=10)
    index.add_document([1, 2, 3, 4])
    index.add_document([5, 6, 7, 8])
    assert index.num_tokens == 8 and len(index.match([1, 2])) == 1
    index.add_document([9, 10, 11])                 # 11 tokens: the oldest request goes
    assert index.num_tokens == 7 and len(index.documents) == 2
    assert len(index.match([1, 2])) == 0 and len(index.match([1])) == 0
    assert index.match([5, 6]).lengths == [2]
    for i in range(2000):                           # many evictions: the array is rebuilt, answers stay
        index.add_document([100 + i % 50, 200 + i % 50, 300])
    assert index.num_tokens <= 10 and len(index.documents) == 3
    assert index.match([100 + 1999 % 50, 200 + 1999 % 50]).lengths == [2]
    assert index.following(index.match([200 + 1999 % 50]).positions, 2) == [[300]]


# ---- the proposer ---------------------------------------------------------------------------
def test_no_match_no_draft():
    proposer = SuffixProposer(SuffixCache(1000))
    proposer.begin([1, 2, 3, 4])
    proposal = _propose(proposer, [1, 2, 3, 4])
    assert proposal.tokens == [] and proposal.time_s >= 0


def test_the_request_drafts_from_its_own_text_and_then_from_earlier_replies():
    cache = SuffixCache(1000)
    first = SuffixProposer(cache)
    first.begin(TEXT[:9])                                   # the prompt
    proposal = _propose(first, TEXT)
    assert (proposal.tokens, proposal.source) == ([4, 9, 2], REQUEST)     # "1 2 3" before: what followed it
    first.finished(TEXT + [4, 9, 7, 20, 21, 22, 23], prompt_len=9)
    assert cache.index.num_tokens == 10                     # its output, not its prompt
    second = SuffixProposer(cache)
    second.begin([30, 31, 7, 20])                           # "7 20" is in the first reply only
    proposal = _propose(second, [30, 31, 7, 20])
    assert (proposal.tokens, proposal.source) == ([21, 22], GLOBAL)
    assert proposal.trimmed(1).source == GLOBAL
    cache.record(GLOBAL, 2, 1)
    cache.record(REQUEST, 3, 2)
    counters = cache.counters()
    assert (counters["draft_tokens_from_request"], counters["accepted_from_request"]) == (3, 2)
    assert (counters["draft_tokens_from_global"], counters["accepted_from_global"]) == (2, 1)
    assert counters["proposal_ms_median"] >= 0
    cache.clear()
    assert cache.index.num_tokens == 0 and cache.drafted == {REQUEST: 0, GLOBAL: 0}
    assert _propose(second, [30, 31, 7, 20]).tokens == []


def test_a_tree_keeps_to_the_shape_it_is_asked_for():
    index = SuffixIndex()
    for continuation in ([5, 6, 7], [5, 6, 8], [9, 1, 2], [10, 3, 4]):
        index.add_document([1, 2, 3] + continuation)
    match = index.match([1, 2, 3])
    assert match.lengths == [3, 3, 3, 3]
    tree, _ = best_draft(index, match, 8, 2.0, 0.1)                        # 2.0 x 3: 6 nodes
    assert tree.tokens == [5, 6, 10, 9, 3, 1]          # 1/2, 1/2, then the 1/4s: shallower, then more recent first
    assert [len(c) for c in tree.children()] == [3, 1, 0, 1, 1, 0, 0]
    narrow, _ = best_draft(index, match, 8, 2.0, 0.1, top_k=1)
    assert narrow.tokens == [5, 6, 8] and narrow.is_chain()                # one child a node: a chain
    shallow, _ = best_draft(index, match, 8, 2.0, 0.1, max_depth=1)
    assert sorted(shallow.tokens) == [5, 9, 10] and max(shallow.depths) == 1


def test_the_request_index_grows_by_appending():
    proposer = SuffixProposer(SuffixCache(1000))
    proposer.begin([1, 2, 3])
    _propose(proposer, [1, 2, 3])
    _propose(proposer, [1, 2, 3, 4, 1, 2])
    assert proposer.own.end == 6 and proposer.own.tokens(0, 6) == [1, 2, 3, 4, 1, 2]
    assert _propose(proposer, [1, 2, 3, 4, 1, 2]).tokens == [3, 4]


# ---- the engine ------------------------------------------------------------------------------
def _record_trees(monkeypatch) -> list:
    """The trees the suffix proposer drafts from now on (the engine asks it for trees)."""
    trees = []
    propose_tree = SuffixProposer.propose_tree

    def recording(self, *args):
        proposal = propose_tree(self, *args)
        trees.append(proposal.tree)
        return proposal
    monkeypatch.setattr(SuffixProposer, "propose_tree", recording)
    return trees


@pytest.mark.parametrize("kv,prefix", [("auto", True), ("fp8_e4m3", False)])
def test_greedy_with_suffix_drafts_is_token_identical_alone_and_batched(make_tiny_engine, monkeypatch, kv, prefix):
    base = make_tiny_engine(kv_cache_dtype=kv, enable_prefix_caching=prefix)
    prompts = [base.encode(chat(q)) for q in ("What is the capital of France?", "Name three colours.", "Count to five.")]
    expected = [base.generate_text(p, GREEDY)[1] for p in prompts]
    prompts.append(prompts[0] + expected[0] + prompts[0])           # repeats itself: long matches
    expected.append(base.generate_text(prompts[3], GREEDY)[1])
    eng = make_tiny_engine(kv_cache_dtype=kv, enable_prefix_caching=prefix)
    eng.reconfigure(proposer="suffix", num_speculative_tokens=8, suffix_spec_factor=3.0, suffix_min_prob=0.05)
    trees = _record_trees(monkeypatch)
    outs = [eng.generate_text(p, GREEDY) for p in prompts]
    assert [o[1] for o in outs] == expected
    assert 0 < sum(o[2].accepted for o in outs) < sum(o[2].proposed for o in outs)
    assert together(eng, prompts, GREEDY) == expected                      # all four in the same steps, global index full
    assert any(not t.is_chain() for t in trees)   # branching trees were verified
    counters = eng.speculator.suffix_cache.counters()
    assert counters["draft_tokens_from_request"] > 0 and counters["draft_tokens_from_global"] > 0
    assert all(r.blocks.num_used_blocks == 0 for r in eng.runners())


def test_sampled_suffix_trees_keep_the_target_distribution(make_engine, monkeypatch):
    """Temperature 1 on the real model: after a few replies the global index holds earlier
    second tokens, so the second token is drafted as a tree of sibling point masses (recursive
    rejection); its frequencies match the target's own probabilities (chi-square)."""
    eng = make_engine(enable_prefix_caching=True)
    eng.reconfigure(proposer="suffix", num_speculative_tokens=4, suffix_spec_factor=4.0)
    trees = _record_trees(monkeypatch)
    assert_second_token_follows_the_target(eng, eng.encode(chat("Name a colour.")), max_tokens=4)
    assert sum(len(t.children()[0]) > 1 for t in trees) >= 50      # siblings at the second token
    assert eng.speculator.suffix_cache.counters()["draft_tokens_from_global"] > 0


def test_the_ceiling_counts_the_passes_an_oracle_drafting_from_earlier_text_needs():
    from engine.speculative.suffix_ceiling import ceiling, ceiling_passes
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    # 11 never had a successor: one plain pass (token 1); then 2..5 follow an earlier 1 (4 drafts
    # + the pass's token 6); then 7, 8, 9 follow the earlier 6
    assert ceiling_passes(prompt, [1, 2, 3, 4, 5, 6, 7, 8, 9], k=4) == 3
    assert ceiling_passes(prompt, [1, 2, 3, 4, 5, 6, 7, 8, 9], k=1) == 5
    assert ceiling_passes([5], [6, 7, 8], k=4) == 3               # nothing to copy: a pass a token
    # an earlier reply is a source (as the global index); an earlier prompt is not
    c = ceiling([[5], [9]], [[6, 7, 8], [5, 6, 7, 8]], k=4)
    assert c == {"tokens": 7, "passes": 6, "tokens_per_pass": 7 / 6}
