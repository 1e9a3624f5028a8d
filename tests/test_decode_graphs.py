"""Uniform passes (a decode, a verify of k+1 rows) through the compiled step over persistent
buffers, recorded per batch size and replayed (engine.runtime.decode_graphs), on the CPU's
stand-in for CUDA graph capture: one graph with attention inside, today's tokens whatever
the padding, and across a reconfigure that rebuilds the pool."""
import pytest
import torch

from engine import SamplingParams
from engine.runtime import decode_graphs
from engine.runtime.compiled_step import compiled_graphs
from tests.conftest import together

GREEDY = SamplingParams(max_tokens=10, stop_on_eos=False)


def prompts(count: int) -> list[list[int]]:
    return [list(range(5 + 3 * i, 12 + 5 * i)) for i in range(count)]


@pytest.fixture
def padded(monkeypatch):
    """The CPU records batch sizes as CUDA does: a uniform pass is padded up to one of them."""
    monkeypatch.setitem(decode_graphs.BATCH_SIZES, "cpu", (2, 4, 8, 16))


def general_path(eng):
    """The engine as before the decode graphs: every pass takes forward_batch's general path."""
    eng.runner.uniform_rows = lambda items: None
    return eng


def test_padded_batches_replay_todays_tokens_also_after_the_pool_is_rebuilt(make_tiny_engine, padded):
    """1, 3 and 9 requests at once decode as batches of 2, 4 and 16 (the padded sequences repeat
    the last real one, its slot included) and give the tokens of the general path; after
    `reconfigure` rebuilds the pool (FP8), new buffers are recorded and the tokens still agree."""
    reference = general_path(make_tiny_engine(compile="on"))
    eng = make_tiny_engine(compile="on")
    recorded = set()
    for count in (1, 3, 9):
        assert together(eng, prompts(count), GREEDY) == together(reference, prompts(count), GREEDY)
        recorded |= {key[1:] for key in eng.runner.decode_graphs.recordings}
    graphs = eng.runner.decode_graphs
    assert recorded == {(1, 2), (1, 4), (1, 16)}
    assert graphs.replays >= 3 * (GREEDY.max_tokens - 2)
    # a replay is the graph's call alone, over the buffers' own tensors (nothing copied a step)
    assert all(r.prepared is not None for r in graphs.recordings.values())
    for e in (reference, eng):
        e.reconfigure(kv_cache_dtype="fp8_e4m3")
    assert eng.runner.decode_graphs is not graphs and not eng.runner.decode_graphs.recordings
    assert together(eng, prompts(3), GREEDY) == together(reference, prompts(3), GREEDY)
    assert eng.runner.decode_graphs.replays > 0


def test_decodes_and_verifies_are_one_graph_with_attention_inside(make_tiny_engine, monkeypatch):
    """Decodes of 1, 4 and 16 sequences and verifies of k+1 = 4 rows each run one call of the one
    compiled graph: nothing compiles after the first pass, dynamo breaks the graph nowhere, and
    attention runs inside it (its Python paths are made to fail for the decodes: the graph calls
    our C++ op with the pool and the pass's rows as arguments)."""
    from torch._dynamo.utils import counters

    from engine.layers import attention_op
    from engine.models import llama
    plain = make_tiny_engine(compile="on")
    verify = make_tiny_engine(compile="on", proposer="draft", draft_model="self:1", num_speculative_tokens=3)
    for eng in (plain, verify):
        eng.generate_text(prompts(1)[0], GREEDY)            # the target's graph and the draft's, built
    before, breaks = compiled_graphs(), sum(counters["graph_break"].values())

    def outside(*args, **kwargs):
        raise AssertionError("attention ran outside the graph's C++ op")
    with monkeypatch.context() as patched:
        patched.setattr(attention_op, "attention", outside)
        patched.setattr(llama, "attention", outside)
        recorded = set()
        for count in (1, 4, 16):
            together(plain, prompts(count), GREEDY)
            recorded |= {key[1:] for key in plain.runner.decode_graphs.recordings}
    together(verify, prompts(4), GREEDY)                    # (its one-layer draft model runs eagerly)
    assert compiled_graphs() == before and sum(counters["graph_break"].values()) == breaks
    assert recorded >= {(1, 1), (1, 4), (1, 16)}
    assert any(key[1] == 4 for key in verify.runner.decode_graphs.recordings)
    assert plain.runner.attention_mode == "cpu"


def test_buffers_grow_for_more_sequences_and_longer_tables(make_tiny_engine, monkeypatch):
    """Buffers start small and are made again, larger, for a pass that does not fit (more
    sequences, a longer block table): the tokens are the general path's."""
    monkeypatch.setattr(decode_graphs, "FIRST_SEQS", 2)
    monkeypatch.setattr(decode_graphs, "FIRST_BLOCKS", 2)
    long = SamplingParams(max_tokens=40, stop_on_eos=False)
    eng = make_tiny_engine(compile="on", block_size=4)
    reference = general_path(make_tiny_engine(compile="on", block_size=4))
    assert together(eng, prompts(5), long) == together(reference, prompts(5), long)
    buffers = eng.runner.decode_graphs.buffers[1]
    longest = max(len(p) for p in prompts(5)) + long.max_tokens - 1
    assert buffers.max_seqs >= 5 and buffers.tables.shape[1] >= -(-longest // 4) > 2


def test_a_fill_pads_with_the_last_sequence():
    """StepBuffers.fill: positions, slots (from the block tables), keys seen, and padded
    sequences that repeat the last real one."""
    buffers = decode_graphs.StepBuffers(4, 3, 2, 3, torch.float32, torch.device("cpu"))
    embedded = torch.arange(12, dtype=torch.float32).view(4, 3)
    buffers.fill(embedded, [5, 2], [[7, 1], [4]], block_size=4, batch=3)
    assert buffers.positions[:6].tolist() == [5, 6, 2, 3, 2, 3]
    assert buffers.slots[:6].tolist() == [1 * 4 + 1, 1 * 4 + 2, 4 * 4 + 2, 4 * 4 + 3, 4 * 4 + 2, 4 * 4 + 3]
    assert buffers.prefix[:6].tolist() == [6, 7, 3, 4, 3, 4]
    assert buffers.tables[:3].tolist() == [[7, 1, 0], [4, 0, 0], [4, 0, 0]]
    assert torch.equal(buffers.h[4:6], embedded[2:4])
    assert buffers.row_seq[:6].tolist() == [0, 0, 1, 1, 2, 2]


def test_a_prompt_scored_whole_takes_the_general_path(make_tiny_engine):
    """Only decode-sized passes (at most k + 1 rows a sequence) go through the buffers: a prompt
    whose every logit is wanted makes no buffers of its length."""
    runner = make_tiny_engine(compile="on").runner
    prompt = list(range(5, 45))
    logits = runner.forward(runner.start(prompt), prompt, logits_for="all")
    assert logits.shape[0] == len(prompt) and len(prompt) not in runner.decode_graphs.buffers
    assert runner.uniform_rows([]) is None
