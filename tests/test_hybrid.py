"""Hybrid linear-attention models (Qwen3.5's text model, `qwen3_5_text`, and Qwen3-Next,
`qwen3_next`, with its experts) against transformers on tiny random configs: three Gated DeltaNet layers and one gated full-attention layer (layer_types'
default 3:1), grouped value heads (2 key heads, 4 value heads), partial RoPE. Logits through the
paged cache and the state cache within the fp32 tolerance used for Llama; greedy output token-
identical on 5 prompts past one chunk of the chunked form (64 tokens), eager and compiled; the
state cache's slots taken and given back with the requests, and counted apart from KV."""
import pytest
import torch

from engine import EngineConfig, SamplingParams
from engine.engine import LLMEngine
from engine.layers import gated_delta
from engine.loading.loader import load_model
from tests.test_models import TINY, _save_tiny, assert_logits_match_transformers, assert_whole_prompt_logits_match


def _qwen3_5(model_type="qwen3_5_text", **extra):
    from transformers import AutoConfig
    fields = dict(TINY, num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=8, linear_value_head_dim=8, max_position_embeddings=256,
                  initializer_range=0.1)     # logits spread wider than at 0.02: no near ties in greedy output
    return AutoConfig.for_model(model_type, **{**fields, **extra})


def _qwen3_next(**extra):
    """Qwen3-Next: per-key-head fused projections, experts with a shared one (layer 1 dense)."""
    return _qwen3_5(model_type="qwen3_next", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                    shared_expert_intermediate_size=48, mlp_only_layers=[1], **extra)


def _qwen3_5_moe():
    """Qwen3.5-MoE: Qwen3.5's layers, every MLP experts with a shared one."""
    return _qwen3_5(model_type="qwen3_5_moe_text", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                    shared_expert_intermediate_size=48)


CONFIGS = {"qwen3_5_text": _qwen3_5, "qwen3_next": _qwen3_next}


def test_logits_match_transformers_compiled(tmp_path):
    """test_models' protocol (a 10-token prefill, 5 decodes, an 8-token chunk) through the compiled step."""
    assert_logits_match_transformers(tmp_path, _qwen3_5)


@pytest.mark.parametrize("name", [*sorted(CONFIGS), "qwen3_5_moe_text"])
def test_logits_match_transformers_eager(tmp_path, name):
    """The same protocol eagerly (the greedy tests below run qwen3_next compiled too)."""
    from engine.runtime.model_runner import ModelRunner
    ref = _save_tiny(tmp_path, CONFIGS.get(name, _qwen3_5_moe))
    runner = ModelRunner(load_model(str(tmp_path)), EngineConfig(block_size=4, num_blocks=32, compile="off"),
                         torch.device("cpu"))
    ids = torch.randint(0, TINY["vocab_size"], (1, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits[0]
    seq = runner.start(ids[0, :10].tolist())
    got = [runner.forward(seq, ids[0, :10].tolist(), logits_for="all")]
    got += [runner.forward(seq, [int(ids[0, t])]) for t in range(10, 15)]
    got.append(runner.forward(seq, ids[0, 15:].tolist(), logits_for="all"))
    assert (torch.cat(got) - expected).abs().max() < 1e-4
    # a prefill of all 23 (the chunked form: a pass whose every row wants logits goes row by row)
    chunked = runner.forward(runner.start(ids[0].tolist()), ids[0].tolist(), logits_for=22)
    assert (chunked - expected[1:]).abs().max() < 1e-4


def test_chunked_form_equals_the_recurrent_one():
    """The chunked form (prefill) computes what the token-by-token loop (decode) does, from a
    non-zero state and over more than one chunk with a ragged end."""
    g = torch.Generator().manual_seed(3)
    heads, length, dk, dv = 3, 150, 8, 5
    q, k = (gated_delta.l2norm(torch.randn(heads, length, dk, generator=g)) for _ in range(2))
    v = torch.randn(heads, length, dv, generator=g)
    decay = -torch.rand(heads, length, generator=g)
    beta = torch.rand(heads, length, generator=g)
    state = torch.randn(heads, dk, dv, generator=g)
    out_r, state_r = gated_delta.recurrent(q, k, v, decay, beta, state)
    out_c, state_c = gated_delta.chunked(q, k, v, decay, beta, state)
    assert (out_r - out_c).abs().max() < 1e-4 and (state_r - state_c).abs().max() < 1e-4


def test_a_prefill_chunk_is_computed_in_pieces_on_the_sequences_chunk_grid():
    """A chunk's pieces (engine.layers.linear_attention_op.pieces): cut at the boundaries whose
    state is saved, and so that the chunked form's 64-token chunks lie on the multiples of 64 of
    the sequence, wherever the scheduler cut the chunk (the state at each comes free)."""
    from engine.layers.linear_attention_op import pieces
    assert pieces(0, 150, [64, 128, 144]) == [(0, 64), (64, 128), (128, 144), (144, 150)]
    assert pieces(0, 150, [144]) == [(0, 144), (144, 150)]
    assert pieces(48, 96, [64, 80]) == [(48, 64), (64, 80), (80, 96)]
    assert pieces(100, 300, []) == [(100, 128), (128, 300)]
    assert pieces(6, 14, [12]) == [(6, 12), (12, 14)]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def hybrid_folder(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    _save_tiny(folder, CONFIGS[request.param])
    return folder


PROMPT_LENGTHS = (5, 33, 70, 97, 131)        # three past one 64-token chunk, one past two
# At transformers' default init (std 0.02) a tiny model's logits lie so close that greedy output met
# near ties (a margin of 0.003 on a qwen3_next prompt of 131 tokens), where transformers' cached
# generate picked another token than its own full forward pass (which ours matched, to 1e-7): the
# configs use std 0.1.
SEED = 11


@pytest.mark.parametrize("compile_mode", ["off", "on"])
def test_greedy_output_is_token_identical_to_transformers(hybrid_folder, compile_mode):
    from engine.loading.loader import transformers_model
    loaded = load_model(str(hybrid_folder))
    ref = transformers_model(loaded.folder).eval()
    eng = LLMEngine(loaded, EngineConfig(kv_cache_bytes=4 * 2**20, compile=compile_mode), torch.device("cpu"))
    rng = torch.Generator().manual_seed(SEED)
    for n in PROMPT_LENGTHS:
        prompt = torch.randint(0, TINY["vocab_size"], (n,), generator=rng).tolist()
        ours = eng.generate_text(prompt, SamplingParams(max_tokens=8, stop_on_eos=False))[1]
        with torch.no_grad():
            theirs = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, n:].tolist()
        assert ours == theirs, f"prompt of {n} tokens"
    runner = eng.runner
    assert runner.states.num_used_slots == 0            # every request gave its slot back
    if compile_mode == "on":
        assert runner.compiled is not None and len(runner.compiled.row_counts) > 1


# ---- many requests at once: the state cache beside the paged KV cache ----------------------
@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def tiny_hybrid(request, tmp_path_factory):
    """The synthetic tiny Qwen3.5 (the default model's tokenizer), eager."""
    from engine.loading.synthetic import write_checkpoint
    folder = write_checkpoint(tmp_path_factory.mktemp("tiny-qwen3.5"), "tiny-qwen3.5", seed=0)
    return load_model(str(folder), dtype=request.param)


_SOLO: dict[int, list[list[int]]] = {}


def solo_greedy(loaded) -> list[list[int]]:
    """test_batching's eight prompts, each alone, greedy, without speculation (once per model)."""
    from tests.test_batching import params_for, prompts, solo
    if id(loaded) not in _SOLO:
        _SOLO[id(loaded)] = [solo(loaded, p, params_for(i, False)) for i, p in enumerate(prompts(loaded))]
    return _SOLO[id(loaded)]


def test_eight_concurrent_requests_give_their_solo_tokens(tiny_hybrid):
    """test_batching's eight requests (5..150 tokens, chunked prefills) under its pool pressure:
    each gives its solo tokens, with a preemption (its state slot given back and taken anew, its
    state restored from the prefix cache's snapshots where they survived) and a prefix hit: the
    second request's 64 shared tokens, the state restored at that block boundary (which the first
    request's chunk [48, 96) crossed: a multiple of the chunked form's 64 tokens, saved)."""
    from tests.test_batching import PRESSURE, params_for, prompts, run_together
    from tests.test_batching import engine as make_engine
    all_prompts, all_params = prompts(tiny_hybrid), [params_for(i, False) for i in range(8)]
    alone = solo_greedy(tiny_hybrid)
    eng = make_engine(tiny_hybrid, **PRESSURE)
    together, stats = run_together(eng, all_prompts, all_params)
    assert [together[i] for i in range(8)] == alone
    assert sum(s.preemptions for s in stats.values()) >= 1
    assert (stats[1].prefix_hit_tokens, stats[1].prefix_recomputed_tokens) == (64, 0)
    assert eng.settings()["prefix_caching"].startswith("on: a hit restores the linear-attention layers' state")
    assert eng.runner.states.num_used_slots == 0 and eng.runner.blocks.num_used_blocks == 0


def test_state_bytes_are_counted_apart_from_kv_bytes(tiny_hybrid):
    """Only the full-attention layer (one in four) has KV; each running sequence holds one state
    slot of the three linear layers, whatever its length, and gives it back when it ends."""
    from tests.test_batching import engine as make_engine
    eng = make_engine(tiny_hybrid)
    runner, config = eng.runner, tiny_hybrid.hf_config
    assert runner.kv.shape.num_layers == 1
    itemsize = torch.empty((), dtype=runner.model_dtype).element_size()
    conv = (2 * 2 * 16 + 4 * 16) * 3 * itemsize                      # conv_dim x (K - 1) inputs
    recurrent = 4 * 16 * 16 * 4                                       # Hv x Dk x Dv, float32
    assert runner.states.bytes_per_slot == 3 * (conv + recurrent)
    plan = eng.settings()["memory_plan"]["state"]
    assert plan["state_bytes_per_sequence"] == runner.states.bytes_per_slot
    assert plan["state_pool_bytes"] == plan["state_slots"] * runner.states.bytes_per_slot
    # the prefix cache's snapshots: 4 a slot, at most a quarter of the 8 MiB left after the slots
    slot, left = runner.states.bytes_per_slot, 8 * 2**20 - 33 * runner.states.bytes_per_slot
    assert plan["state_slots"] == 33 and plan["prefix_snapshots"] == min(4 * 33, left // 4 // slot)
    assert plan["prefix_snapshot_bytes"] == runner.snapshots.pool_bytes == plan["prefix_snapshots"] * slot
    assert eng.plan.num_blocks == (left - plan["prefix_snapshot_bytes"]) // eng.plan.kv_bytes_per_block
    a = eng.submit(list(range(100, 140)), SamplingParams(max_tokens=3, stop_on_eos=False))
    eng.submit(list(range(200, 210)), SamplingParams(max_tokens=3, stop_on_eos=False))
    eng.step()
    assert runner.state_bytes_held() == 2 * runner.states.bytes_per_slot
    while eng.has_work:
        eng.step()
    assert runner.state_bytes_held() == 0 and a is not None
    assert config.layer_types.count("full_attention") == 1


# ---- speculation: the state rolled back to the last accepted token -------------------------
@pytest.fixture(scope="module")
def llama_draft(tmp_path_factory):
    """A draft that shares the target's tokenizer: the tiny synthetic Llama (its own KV, no state)."""
    from engine.loading.synthetic import write_checkpoint
    return str(write_checkpoint(tmp_path_factory.mktemp("tiny-draft"), "tiny", seed=1))


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_draft_chains_and_trees_verify_with_the_state_rolled_back(tiny_hybrid, llama_draft, shape):
    """Greedy speculation (a draft's chain of 3, or its 3:4:10 tree) verified by the hybrid
    target: each linear layer keeps the state after every row of the verify pass (a tree's row
    after its parent's) and goes back to the last accepted one. Eight requests speculating
    together under the pool pressure (with a preemption, and prefix hits) give each its tokens
    alone without speculation."""
    from tests.test_batching import PRESSURE, params_for, prompts, run_together
    from tests.test_batching import engine as make_engine
    if tiny_hybrid.model.lm_head.weight.dtype != torch.float32:
        pytest.skip("speculation is checked in fp32 (bf16 batching: test_eight_concurrent_requests...)")
    spec = dict(proposer="draft", draft_model=llama_draft, num_speculative_tokens=3, speculation_policy="fixed")
    if shape == "tree":
        spec["draft_tree"] = "3:4:10"
    all_prompts, all_params = prompts(tiny_hybrid), [params_for(i, False) for i in range(8)]
    plain = solo_greedy(tiny_hybrid)
    together, stats = run_together(make_engine(tiny_hybrid, **PRESSURE, **spec), all_prompts, all_params)
    assert [together[i] for i in range(8)] == plain
    assert sum(s.preemptions for s in stats.values()) >= 1
    assert sum(s.proposed for s in stats.values()) > 0


def test_bench_memory_gives_kv_and_state_bytes_apart_for_qwen3_5():
    """`bench memory --config qwen3.5-9b --context 32768` (transformers' Qwen3.5-9B-style config),
    checked by hand: KV in the 8 full layers only, 2 x 8 x 4 KV heads x 256 x 2 bytes = 32 KiB a
    token, 1 GiB a 32k sequence; the state of the 24 linear layers, (8192 conv channels x 3
    inputs x 2 bytes + 32 heads x 128 x 128 x 4 bytes) x 24 = 51,511,296 bytes a sequence."""
    from engine.bench.model_memory import model_memory
    from engine.loading.synthetic import make_config
    figures = model_memory(make_config("qwen3.5-9b"), 32768)
    assert (figures["kv"]["full_layers"], figures["kv"]["linear_layers"]) == (8, 24)
    assert figures["kv"]["bytes_per_token"]["bf16"] == 32768
    assert figures["kv"]["bytes_per_sequence"]["bf16"] == 2**30
    assert figures["state"]["bytes_per_sequence"] == (8192 * 3 * 2 + 32 * 128 * 128 * 4) * 24 == 51_511_296


def test_a_hybrid_model_as_a_draft_is_refused_by_name(tiny_hybrid):
    """A draft rolls back over several of its own passes; a hybrid model's state keeps one pass's."""
    from engine.errors import UnsupportedModelError
    from engine.loading.loader import load_draft
    with pytest.raises(UnsupportedModelError, match="qwen3_5_text.*cannot draft"):
        load_draft("self:2", tiny_hybrid)


def test_a_multimodal_qwen3_5_folder_serves_its_text_model(tmp_path):
    """The released Qwen3.5 folders are multimodal (`qwen3_5`, the text model under
    "model.language_model.", a vision tower under "model.visual.", and a multi-token-prediction
    head under "mtp."): we serve the text model and leave the rest unread."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForImageTextToText
    text = _qwen3_5().to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    make = lambda: AutoConfig.for_model("qwen3_5", text_config=text, vision_config=vision)   # noqa: E731
    torch.manual_seed(0)
    ref = AutoModelForImageTextToText.from_config(make(), dtype=torch.float32).eval()
    ref.save_pretrained(tmp_path, safe_serialization=True)
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({**tensors, "mtp.fc.weight": torch.zeros(4, 4)}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    _save_tokenizer(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.hf_config.model_type == "qwen3_5_text"
    assert_whole_prompt_logits_match(loaded, ref)


def _save_tokenizer(folder) -> None:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    vocab = {f"t{i}": i for i in range(TINY["vocab_size"])}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0"))).save_pretrained(folder)


def test_rollback_and_compact_restore_the_state_after_the_last_accepted_row(tiny_hybrid):
    """A verify pass whose drafts are accepted in part: a chain rolled back after its second row,
    and a tree compacted to the root, its second child and that child's child. The next decode
    gives the logits of plain decoding (the state is the one after the last accepted token, in
    every linear layer, and the full layer's KV was moved with it)."""
    from engine.layers.attention_metadata import TreeRows
    from engine.runtime.model_runner import ModelRunner, PassItem
    if tiny_hybrid.model.lm_head.weight.dtype != torch.float32:
        pytest.skip("checked in fp32")
    runner = ModelRunner(tiny_hybrid, EngineConfig(block_size=4, num_blocks=64, compile="off"), torch.device("cpu"))
    prompt = list(range(3000, 3021))
    plain = runner.start(prompt)
    logits, tokens = [runner.forward(plain, prompt)], []
    for _ in range(4):                                         # plain greedy decoding
        tokens.append(int(logits[-1].argmax()))
        logits.append(runner.forward(plain, [tokens[-1]]))
    t0, t1, t2, t3 = tokens
    wrong = (t1 + 1) % 49152
    start = len(prompt)

    chain = runner.start(prompt)
    runner.forward(chain, prompt)
    runner.forward(chain, [t0, t1, wrong, t2], logits_for=4)   # accepted: t1; rejected from `wrong` on
    runner.rollback(chain, start + 2)
    assert torch.allclose(runner.forward(chain, [t2]), logits[3], atol=1e-5)

    tree = runner.start(prompt)
    runner.forward(tree, prompt)
    rows = TreeRows(start, [start + r for r in range(4)], [[start], [start, start + 1], [start, start + 2],
                                                             [start, start + 2, start + 3]])
    runner.forward_batch([PassItem(tree, [t0, wrong, t1, t2], 4, rows)])    # root; wrong | t1 -> t2
    runner.compact(tree, start, [0, 2, 3])
    assert tree.num_computed == start + 3
    assert torch.allclose(runner.forward(tree, [t3]), logits[4], atol=1e-5)
    for seq in (plain, chain, tree):
        runner.end(seq)
    assert runner.states.num_used_slots == 0


def test_a_hybrid_model_cut_to_its_linear_layers_serves_without_kv(tmp_path):
    """`bench load --synthetic qwen3.5-9b --layers 3` keeps three linear layers and no full one:
    no KV layer in the pool (blocks only count tokens), the state cache does the rest."""
    from engine.loading.synthetic import write_checkpoint
    cut = {"preset": "tiny-qwen3.5", "num_hidden_layers": 3, "layer_types": ["linear_attention"] * 3}
    eng = LLMEngine(load_model(str(write_checkpoint(tmp_path, cut, dtype=torch.float32))),
                    EngineConfig(kv_cache_bytes=2**20, compile="off"), torch.device("cpu"))
    reply = eng.generate_text(list(range(100, 130)), SamplingParams(max_tokens=5, stop_on_eos=False))[1]
    assert len(reply) == 5 and eng.runner.kv.shape.num_layers == 0 and eng.runner.bytes_held() == 0


# ---- prefix caching: the state saved at block boundaries -----------------------------------
def test_a_prefix_hit_restores_the_state_saved_at_its_last_block_boundary(tiny_hybrid):
    """Block size 4, 8 blocks, a pool of 3 snapshots. A 14-token prompt computed in two chunks
    ([0, 6), [6, 14)) saves the state at each chunk's last block boundary inside it, 4 and 12
    (and at the multiples of the chunked form's 64 tokens, none here): a hit on 3 blocks restores
    the state at 12 and gives the cold run's logits; a hit on 2 falls back to 4 (the engine counts
    4 cached tokens recomputed). Then the pool's least recently used snapshots go to other
    prompts', a hit whose last block lost its snapshot falls back to the longest one with one,
    and when a block is evicted its snapshot goes with it."""
    from engine.runtime.model_runner import ModelRunner
    runner = ModelRunner(tiny_hybrid, EngineConfig(block_size=4, num_blocks=8, compile="off"), torch.device("cpu"),
                         num_snapshots=3)
    snapshots, blocks, slot_bytes = runner.snapshots, runner.blocks, runner.states.bytes_per_slot
    prompt = list(range(3000, 3014))
    cold = runner.admit(prompt)
    runner.forward(cold, prompt[:6])
    runner.commit(cold, prompt)
    cold_logits = runner.forward(cold, prompt[6:])
    runner.commit(cold, prompt)
    k0, k1, k2 = cold.keys
    assert cold.block_table == [0, 1, 2, 3] and list(snapshots.by_key.items()) == [(k0, 0), (k2, 1)]
    assert (runner.snapshot_bytes_held(), snapshots.pool_bytes) == (2 * slot_bytes, 3 * slot_bytes)
    runner.end(cold)
    assert list(blocks.free_queue) == [3, 4, 5, 6, 7, 2, 1, 0]

    hit = runner.admit(prompt)                   # 3 blocks (never the last token): the state at 12
    assert (hit.block_table, hit.num_computed, hit.num_unrestored_tokens) == ([0, 1, 2], 12, 0)
    assert (runner.forward(hit, prompt[12:]) - cold_logits).abs().max() < 1e-5
    runner.end(hit)

    short = runner.admit(prompt[:9])             # 2 blocks, but no state at 8: back to k0's at 4
    assert (short.block_table, short.num_computed, short.num_unrestored_tokens) == ([0], 4, 4)
    runner.forward(short, prompt[4:9])           # saves the state at 8, its chunk's last boundary
    runner.commit(short, prompt[:9])
    assert short.block_table == [0, 3, 4] and list(snapshots.by_key.items()) == [(k2, 1), (k0, 0), (k1, 2)]
    runner.end(short)
    assert list(blocks.free_queue) == [3, 4, 5, 6, 7, 2, 1, 0]
    other = runner.admit(list(range(5000, 5009)))
    runner.forward(other, list(range(5000, 5009)))   # its state at 8 takes the least recently used: k2's
    runner.commit(other, list(range(5000, 5009)))
    o0, o1 = other.keys
    assert other.block_table == [3, 4, 5] and list(snapshots.by_key.items()) == [(k0, 0), (k1, 2), (o1, 1)]

    fallback = runner.admit(prompt)              # k2's block is cached, its snapshot gone: back to k1
    assert (fallback.block_table, fallback.num_computed, fallback.num_unrestored_tokens) == ([0, 1], 8, 4)
    assert (runner.forward(fallback, prompt[8:]) - cold_logits).abs().max() < 1e-5
    runner.commit(fallback, prompt)              # the state at 12 saved again (k0's snapshot goes)
    assert fallback.block_table == [0, 1, 6, 7] and list(snapshots.by_key.items()) == [(o1, 1), (k1, 2), (k2, 0)]
    runner.end(fallback)
    runner.end(other)
    assert list(blocks.free_queue) == [5, 6, 7, 2, 1, 0, 4, 3]

    filler = runner.admit([9] * 16)              # takes 5, 6, 7 and evicts block 2 (k2): its snapshot goes
    blocks.ensure_capacity(filler, 16)
    assert filler.block_table == [5, 6, 7, 2] and list(snapshots.by_key) == [o1, k1] and snapshots.free == [0]
    runner.end(filler)
    again = runner.admit(prompt)
    assert (again.block_table, again.num_computed, again.num_unrestored_tokens) == ([0, 1], 8, 0)
    runner.end(again)
    blocks.reset_prefix_cache()                  # every key dropped: every snapshot with it
    assert snapshots.num_saved == 0 and runner.snapshot_bytes_held() == 0 and runner.states.num_used_slots == 0


@pytest.mark.parametrize("compile_mode", ["off", "on"])
def test_a_prefix_hit_gives_the_tokens_of_a_cold_run(tiny_hybrid, compile_mode):
    """The engine: a 150-token prompt cold (one chunk: the state saved at 64, 128 and 144), then
    again (a hit on 9 blocks, the state restored at 144), then extended by its reply and a new turn (a hit on the 10 blocks the first reply's
    decode steps reached, the state saved at 160 by a decode step): each gives the tokens of a
    cold run of the same prompt, and says what was served from the cache."""
    if compile_mode == "on" and tiny_hybrid.model.lm_head.weight.dtype != torch.float32:
        pytest.skip("compiled: checked in fp32")
    eng = LLMEngine(tiny_hybrid, EngineConfig(kv_cache_bytes=4 * 2**20, compile=compile_mode), torch.device("cpu"))
    params = SamplingParams(max_tokens=12, stop_on_eos=False)
    prompt = list(range(1000, 1150))
    _, cold, cold_stats = eng.generate_text(prompt, params)
    _, warm, warm_stats = eng.generate_text(prompt, params)
    assert warm == cold and (cold_stats.prefix_hit_tokens, warm_stats.prefix_hit_tokens) == (0, 144)
    follow_up = prompt + cold + list(range(2000, 2005))
    _, extended, stats = eng.generate_text(follow_up, params)
    assert (stats.prefix_hit_tokens, stats.prefix_recomputed_tokens) == (160, 0)
    eng.reset_prefix_cache()
    assert eng.runner.snapshot_bytes_held() == 0
    _, extended_cold, stats = eng.generate_text(follow_up, params)
    assert extended == extended_cold and stats.prefix_hit_tokens == 0


def test_bench_memory_counts_kv_for_the_attention_layers_only():
    """Qwen3.5-9B's shapes: 8 of 32 layers attend (4 KV heads of 256); the 24 linear ones hold a
    fixed state, not KV."""
    from engine.bench.scenarios import cache_bytes
    result = cache_bytes("qwen3.5-9b", 32768)
    assert result["num_layers"] == 8
    assert result["bytes_per_sequence"]["gqa4_fp16"] == 8 * 4 * 256 * 2 * 2 * 32768 == 2**30
