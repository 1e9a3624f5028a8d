"""Draft trees (engine.speculative.tree): the tree mask against a brute-force reference, exact KV
compaction, growth and selection, lossless verification (greedy and sampled), and the
engine with trees on: token-identical greedy output alone and batched, no block leak."""
import pytest
import torch

from engine import SamplingParams
from engine.config import EngineConfig, parse_tree
from engine.errors import ConfigError
from engine.metrics import ACCEPTED, BONUS, RESAMPLED
from engine.runtime.model_runner import ModelRunner, PassItem
from engine.speculative.policy import SpeculationPolicy
from engine.speculative.tree import (
    DraftTree,
    TreeShape,
    greedy_verify,
    grow,
    sample_verify,
    select,
)
from tests.conftest import assert_second_token_follows_the_target, chat, together

GREEDY = SamplingParams(max_tokens=24, stop_on_eos=False)
# 7 nodes: two children of the root, one of them with two children, paths of depth 1..4
TREE = DraftTree([5, 6, 7, 8, 9, 10, 11], [-1, -1, 0, 0, 1, 2, 5], [-0.1, -0.5, -0.3, -0.9, -1.2, -0.6, -0.8])


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # conftest: the module on one thread


@pytest.fixture(scope="module")
def tiny_by_dtype(tmp_path_factory):
    """The tiny model (tests/conftest.py) loaded in a given dtype."""
    from engine.loading.loader import load_model
    from engine.loading.synthetic import write_checkpoint
    from tests.conftest import TINY_SEED
    folder = write_checkpoint(tmp_path_factory.mktemp("tiny-trees"), "tiny", seed=TINY_SEED)
    loaded = {}

    def get(dtype):
        if dtype not in loaded:
            loaded[dtype] = load_model(str(folder), dtype=dtype)
        return loaded[dtype]
    return get


def _runner(model, kv="auto"):
    return ModelRunner(model, EngineConfig(kv_cache_bytes=8 * 2**20, kv_cache_dtype=kv), torch.device("cpu"))


def _slots(runner, seq, n):
    bs = runner.kv.block_size
    return [seq.block_table[p // bs] * bs + p % bs for p in range(n)]


# ---- the tree mask -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,kv", [(torch.float32, "auto"), (torch.bfloat16, "auto"), (torch.bfloat16, "fp8_e4m3"),
                                      (torch.bfloat16, "fp8_e4m3_hadamard")])
def test_each_tree_row_equals_its_path_fed_alone(tiny_by_dtype, dtype, kv):
    """Brute force: every node's logits and hidden state from the tree pass are bitwise those of
    its path fed as a chain in a pass of its own (the context prefilled the same way)."""
    runner = _runner(tiny_by_dtype(dtype), kv)
    prompt, root = list(range(100, 170)), 42
    seq = runner.start(prompt)
    runner.forward(seq, prompt)
    start = seq.num_computed
    (logits, hidden), = runner.forward_batch([PassItem(seq, [root] + TREE.tokens, len(TREE) + 1, TREE.rows(start))])
    for node in [-1] + list(range(len(TREE))):
        path = [] if node < 0 else TREE.path(node)
        alone = runner.start(prompt)
        runner.forward(alone, prompt)
        tokens = [root] + [TREE.tokens[j] for j in path]
        (ref_logits, ref_hidden), = runner.forward_batch([PassItem(alone, tokens, len(tokens))])
        assert torch.equal(ref_logits[-1], logits[node + 1]), f"node {node}"
        assert torch.equal(ref_hidden[-1], hidden[node + 1]), f"node {node}"
        runner.end(alone)
    runner.end(seq)


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_compaction_leaves_exactly_the_chain_kv(tiny_model, kv):
    """After keeping the root and the path to node 6, the sequence's KV bytes (values and FP8
    scales) equal those of feeding that path as a chain, and the blocks past it are freed."""
    runner = _runner(tiny_model, kv)
    prompt, root = list(range(100, 170)), 42
    seq = runner.start(prompt)
    runner.forward(seq, prompt)
    start = seq.num_computed
    runner.forward_batch([PassItem(seq, [root] + TREE.tokens, len(TREE) + 1, TREE.rows(start))])
    path = TREE.path(6)
    runner.compact(seq, start, [0] + [j + 1 for j in path])
    chain = runner.start(prompt)
    runner.forward(chain, prompt)
    runner.forward_batch([PassItem(chain, [root] + [TREE.tokens[j] for j in path], 1)])
    assert seq.num_computed == chain.num_computed == start + 1 + len(path)
    assert len(seq.block_table) == runner.blocks.blocks_for(seq.num_computed)
    a, b = _slots(runner, seq, seq.num_computed), _slots(runner, chain, chain.num_computed)
    for pool in (runner.kv.k, runner.kv.v, runner.kv.k_scale, runner.kv.v_scale):
        if pool is None:
            continue
        flat = pool.flatten(1, 2)
        flat = flat.view(torch.uint8) if flat.element_size() == 1 else flat
        assert torch.equal(flat[:, a], flat[:, b])
    runner.end(seq)
    runner.end(chain)
    assert runner.blocks.num_used_blocks == 0


# ---- growth, selection, verification ------------------------------------------------------
def test_tree_shape_setting():
    assert parse_tree("off") is None and parse_tree("auto") == TreeShape(4, 6, 24)
    assert parse_tree("8:5:32") == TreeShape(8, 5, 32)
    for bad in ("8:5", "a:b:c", "0:5:8", "4:6:999"):
        with pytest.raises(ConfigError, match="draft tree"):
            EngineConfig(draft_tree=bad)


def test_grow_follows_cumulative_confidence():
    """EAGLE-2: each depth keeps the best top_k expansions by cumulative log-probability."""
    vocab = 6
    logp = torch.log_softmax(torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0, -2.0]), -1)

    def expand(frontier, tree):                   # every node sees the same draft distribution
        return logp.repeat(len(frontier), 1)
    tree = grow(logp, expand, TreeShape(top_k=2, depth=3, nodes=64))
    assert tree.parents[:2] == [-1, -1] and tree.tokens[:2] == [0, 1]
    # depth 2: 2 children of each frontier node (4 nodes); depth 3 grows from the best 2 of them
    assert [d for d in tree.depths] == [1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    scores = tree.scores
    for i, p in enumerate(tree.parents):
        if p >= 0:
            assert scores[i] < scores[p]          # confidence only falls along a path
    small = select(tree, 4)
    assert len(small) == 4 and all(p < i for i, p in enumerate(small.parents))
    assert sorted(small.scores, reverse=True) == sorted(tree.scores, reverse=True)[:4]
    assert vocab == logp.shape[0]


def test_greedy_tree_verification_takes_the_longest_matching_path():
    # target argmax per row (root, nodes 0..6): root -> 5 (node 0), node 0 -> 7 (node 2), node 2 -> 10 (node 5),
    # node 5 -> 3 (no child matches: resampled)
    argmax = [5, 7, 0, 10, 0, 0, 3, 0]
    v = greedy_verify(TREE, argmax)
    assert v.path == [0, 2, 5] and v.tokens == [5, 7, 10, 3] and v.kinds == [ACCEPTED] * 3 + [RESAMPLED]
    assert v.rows == [0, 1, 3, 6] and v.attempted_depths == 4
    v = greedy_verify(TREE, [5, 7, 0, 10, 0, 0, 11, 4])      # down to the leaf 6, then a bonus
    assert v.path == [0, 2, 5, 6] and v.tokens == [5, 7, 10, 11, 4] and v.kinds[-1] == BONUS
    v = greedy_verify(TREE, [1] + [0] * 7)                   # nothing matches at the root
    assert v.path == [] and v.tokens == [1] and v.attempted_depths == 1


def test_sibling_rejection_keeps_the_target_distribution():
    """Recursive rejection over a node's children (point masses) emits exactly p."""
    p = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])
    tree = DraftTree([1, 3, 0], [-1, -1, -1], [-1.0, -2.0, -3.0])     # three siblings under the root
    probs = p.repeat(len(tree) + 1, 1)
    g = torch.Generator().manual_seed(0)
    n = 30000
    counts = torch.zeros(5)
    for _ in range(n):
        counts[sample_verify(tree, probs, g).tokens[0]] += 1
    expected = p * n
    statistic = float(((counts - expected) ** 2 / expected).sum())
    p_value = float(torch.special.gammaincc(torch.tensor(2.0), torch.tensor(statistic / 2)))
    assert p_value > 0.001, counts / n


def test_tree_nodes_follow_the_measured_costs():
    policy = SpeculationPolicy()
    scores = [-0.1, -0.3, -0.6, -1.0, -1.5]

    def measured(*widths):
        policy.pass_s.clear()
        for rows, seconds in widths:
            for _ in range(3):
                policy.record_pass(rows, seconds)
    assert policy.choose_tree_nodes(scores, 5) == 3          # a 4-row pass is measured before any is predicted
    measured((1, 0.010), (4, 0.010))
    assert policy.choose_tree_nodes(scores, 5) == 5          # then the whole tree's width
    measured((1, 0.010), (4, 0.0105), (6, 0.011))
    assert policy.choose_tree_nodes(scores, 5) == 5          # nearly free rows: verify them all
    measured((1, 0.010), (4, 0.040), (6, 0.060))
    assert policy.choose_tree_nodes(scores, 5) == 0          # each row costs a step: a plain step pays most
    measured((1, 0.010), (4, 0.010), (6, 0.030))
    assert policy.choose_tree_nodes(scores, 5) == 3          # rows in blocks of 4 (CPU int4): the first block


def test_trees_grow_one_depth_past_what_was_verified():
    policy = SpeculationPolicy()
    assert policy.tree_depth(6) == 6
    for _ in range(4):
        policy.record_tree(1.0, 1, 2, 0.02, depth=2)
    assert policy.tree_depth(6) == 3 and policy.tree_depth(2) == 2
    for _ in range(40):
        policy.record_tree(0.0, 0, 1, 0.02, depth=0)          # trimmed to no node every time
    assert policy.tree_depth(6) == 1


def test_the_trim_calibrates_each_size_of_grown_tree_by_its_own_verified_trees():
    """A suffix tree's size follows its match's length: small trees from short matches accept
    less of their confidence than full ones. Each size class keeps its own ratio; a tree
    trimmed to nothing is no evidence (a window of them once locked the ratio at 0)."""
    policy = SpeculationPolicy()
    assert policy.tree_calibration(1) == 1.0                  # nothing verified yet
    for _ in range(4):
        policy.record_tree(1.0, 0, 1, 0.02, depth=1, grown_nodes=1)       # one-node trees: 0 of 1
        policy.record_tree(8.0, 6, 7, 0.02, depth=8, grown_nodes=8)       # full trees: 6 of 8
    for _ in range(40):
        policy.record_tree(0.0, 0, 1, 0.02, depth=0, grown_nodes=1)       # trimmed to no node
    assert policy.tree_calibration(1) == 0.0
    assert policy.tree_calibration(8) == policy.tree_calibration(12) == 0.75
    assert policy.tree_calibration(3) == 24 / 36              # a class not yet seen: every class's
    # a full tree of certain nodes is still verified though the one-node trees failed
    for rows in range(1, 10):
        for _ in range(2):
            policy.record_pass(rows, 0.010 + 0.0005 * rows)
    assert policy.choose_tree_nodes([0.0] * 8, 8) == 8
    assert policy.choose_tree_nodes([0.0], 8) == 0


def test_a_tree_that_costs_nothing_to_grow_is_always_grown_the_trim_decides():
    policy = SpeculationPolicy()
    policy.record_pass(1, 0.010)
    for _ in range(8):                                        # trees that lost: 1 token in 2 plain steps' time
        policy.record_tree(1.0, 0, 1, 0.020, depth=1, draft_s=0.010)
    assert not policy.grow_tree(1) and "lose" in policy.paused
    free = SpeculationPolicy()
    free.record_pass(1, 0.010)
    for _ in range(8):
        free.record_tree(1.0, 0, 1, 0.020, depth=1, draft_s=0.00005)   # index lookups
    assert free.grow_tree(1) and free.paused is None


# ---- the engine ------------------------------------------------------------------------------
def _no_blocks_in_use(eng) -> bool:
    return all(r.blocks.num_used_blocks == 0 for r in eng.runners())


@pytest.mark.parametrize("kv,prefix", [("auto", True), ("fp8_e4m3", False)])
def test_greedy_with_a_draft_model_tree_is_token_identical_alone_and_batched(make_tiny_engine, kv, prefix):
    base = make_tiny_engine(kv_cache_dtype=kv, enable_prefix_caching=prefix)
    prompts = [base.encode(chat(q)) for q in ("What is the capital of France?", "Name three colours.", "Count to five.")]
    expected = [base.generate_text(p, GREEDY)[1] for p in prompts]
    eng = make_tiny_engine(kv_cache_dtype=kv, enable_prefix_caching=prefix)
    eng.set_draft_model("self:1")
    eng.reconfigure(proposer="draft", draft_tree="3:4:10")
    assert eng.settings()["draft_tree"] == "3:4:10"
    outs = [eng.generate_text(p, GREEDY) for p in prompts]
    assert [o[1] for o in outs] == expected
    assert sum(o[2].accepted for o in outs) > 0 and sum(o[2].proposed for o in outs) > 0
    assert _no_blocks_in_use(eng)
    assert together(eng, prompts, GREEDY) == expected                      # all three in the same steps
    assert _no_blocks_in_use(eng)


def test_only_a_branching_tree_pays_for_tree_attention(make_tiny_engine, monkeypatch):
    """A chain (drafted as one, grown as a top-1 tree, or a tree cut to one path) is verified
    as plain causal rows; only a branching tree's pass carries TreeRows, the costlier
    attention path."""
    eng = make_tiny_engine()
    eng.set_draft_model("self:1")
    verified, prepare = [], eng._prepare          # (the drafts branch, the pass attends as a tree)

    def spy(scheduled, other_rows=0):
        work = prepare(scheduled, other_rows)
        if work.drafts:
            verified.append((not work.proposal.tree.is_chain(), work.item.tree is not None))
        return work
    monkeypatch.setattr(eng, "_prepare", spy)
    prompt = eng.encode(chat("Count to five."))
    for tree, branches in (("off", False), ("1:4:4", False), ("3:4:10", True)):
        eng.reconfigure(proposer="draft", draft_tree=tree)
        verified.clear()
        eng.generate_text(prompt, GREEDY)
        assert verified and all(branching == as_tree for branching, as_tree in verified), tree
        assert any(branching for branching, _ in verified) == branches, tree


def test_no_block_leak_after_200_tree_steps_with_cancels(make_tiny_engine):
    eng = make_tiny_engine(enable_prefix_caching=True)
    eng.set_draft_model("self:1")
    eng.reconfigure(proposer="draft", draft_tree="3:4:10")
    params = SamplingParams(max_tokens=40, stop_on_eos=False, temperature=1.0, seed=1)
    prompts = [eng.encode(chat(f"Tell me about the number {i}.")) for i in range(12)]
    steps = tree_steps = submitted = 0
    while steps < 200:
        while len(eng.requests) < 3 and submitted < len(prompts) * 4:
            eng.submit(prompts[submitted % len(prompts)], params)
            submitted += 1
        for ev in eng.step():
            tree_steps += ev.tree_nodes > 0
        steps += 1
        if steps % 7 == 0 and eng.requests:
            eng.cancel(next(iter(eng.requests)))
    eng.cancel()
    eng.step()
    assert tree_steps > 50 and not eng.has_work
    assert _no_blocks_in_use(eng)


def test_greedy_with_the_shipped_head_tree_is_token_identical_alone_and_batched(make_engine):
    eng = make_engine(kv_cache_dtype="fp8_e4m3", enable_prefix_caching=True)
    prompts = [eng.encode(chat(q)) for q in ("Explain what a hash table is in two sentences.", "Name a colour.")]
    expected = [eng.generate_text(p, GREEDY)[1] for p in prompts]
    eng.reconfigure(proposer="eagle", draft_tree="4:5:16")
    _, out, stats = eng.generate_text(prompts[0], GREEDY)
    assert out == expected[0]
    assert 0 < stats.accepted < stats.proposed and stats.tree_steps > 0
    assert together(eng, prompts, GREEDY) == expected                      # two trees in the same steps
    assert _no_blocks_in_use(eng)


def test_sampled_eagle_tree_keeps_the_target_distribution(make_engine):
    """Temperature 1 on the real model with a tree: the second token goes through the head's
    tree and recursive rejection over siblings; given the commonest first token, its
    frequencies match the target's own probabilities (chi-square, top-k 4 support)."""
    eng = make_engine(enable_prefix_caching=True)
    eng.reconfigure(proposer="eagle", draft_tree="4:2:8")
    assert_second_token_follows_the_target(eng, eng.encode(chat("Name a colour.")))


def test_a_draft_model_tree_left_unverified_is_rolled_back_before_the_next_one(tiny_by_dtype):
    """A draft model's tree the target never verified (trimmed to no node, or cut short by the
    draft's own full pool: the request decodes plainly and `accepted` is not called) leaves its
    rows in the draft's cache. The next proposal rolls them back to the last token the draft
    agrees on and catches up from there: the tree a fresh draft grows. (It used to feed an empty
    catch-up pass: IndexError in attention.prepare, under pool pressure with 8 requests.)"""
    from engine.speculative.spec_decode import DraftModelProposer
    model = tiny_by_dtype(torch.float32)
    prompt, shape = list(range(200, 230)), TreeShape(3, 4, 10)
    stale = DraftModelProposer(_runner(model))
    stale.begin(prompt)
    stale.propose_tree(prompt, shape, GREEDY, None)               # never verified
    assert stale.seq.num_computed == 30 + 9                        # the nodes it expanded (all but the last depth)
    later = prompt + [41]                                          # the target decoded one token alone
    fresh = DraftModelProposer(_runner(model))
    fresh.begin(later)
    got, want = (p.propose_tree(later, shape, GREEDY, None).tree for p in (stale, fresh))
    assert (got.tokens, got.parents) == (want.tokens, want.parents)
    assert stale.seq.num_computed == fresh.seq.num_computed == 31 + 9
