"""A GGUF's k-quants served as stored: each block type decoded exactly into the kernels' forms
(gguf.quants.dequantize is the oracle), Q4_K_M and Q5_K_M files' linears served as stored with
no float read of them, mixed fused linears stacked, and a type no kernel takes dequantized and
named. The table of stored formats (engine.loading.stored_formats) decides each of them."""
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

from engine.layers import quantized_linear
from engine.layers.quantized_linear import INT4, INT8_GROUPS, Q4_K, Q6_K
from engine.loading.gguf_tensors import GGUFTensors
from engine.loading.loader import load_model, transformers_model
from engine.loading.synthetic_gguf import quantize, recipe_type, use_more_bits, write_gguf
from engine.loading.synthetic import make_config
from engine.models.llama import Linear
from tests.conftest import LOGITS_TEXT, our_logits
from tests.kernels_required import excused, skip_unless_runs

HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 4, 2, 64, 256
# One tensor per stored type, named as a Llama model's: q and k have their rows permuted by
# llama.cpp, which transformers' processor (and so our decoding) undoes.
STORED = {"blk.0.attn_q": ("model.layers.0.self_attn.q_proj", "Q4_K", HEADS * HEAD_DIM),
          "blk.0.attn_k": ("model.layers.0.self_attn.k_proj", "Q6_K", KV_HEADS * HEAD_DIM),
          "blk.0.attn_v": ("model.layers.0.self_attn.v_proj", "Q8_0", KV_HEADS * HEAD_DIM),
          "blk.0.attn_output": ("model.layers.0.self_attn.o_proj", "Q4_1", HIDDEN),
          "blk.0.ffn_gate": ("model.layers.0.mlp.gate_proj", "Q4_0", 512), "blk.0.ffn_up": ("model.layers.0.mlp.up_proj", "Q5_0", 512),
          "blk.0.ffn_down": ("model.layers.0.mlp.down_proj", "Q5_K", HIDDEN), "output": ("lm_head", "Q5_1", 256)}
# A small Llama in llama.cpp's Q4_K_M mix: ffn_down's rows (384) are not whole super-blocks, so
# they fall back as llama.cpp's do (Q4_K -> Q5_0 in layers 0-1, Q6_K -> Q8_0 in layers 2-3,
# which use_more_bits picks, as it picks their attn_v for Q6_K); the tied embedding is Q6_K.
MIX = {"preset": "tiny", "hidden_size": HIDDEN, "intermediate_size": 384, "num_attention_heads": HEADS,
       "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "num_hidden_layers": 4, "tie_word_embeddings": True}


@pytest.fixture(scope="module")
def blocks_file(tmp_path_factory):
    """A GGUF of one tensor per type, and each tensor's weights as the oracle dequantizes them
    (in transformers' row order, by transformers' own processor)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS
    path = tmp_path_factory.mktemp("blocks") / "blocks.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    rng = np.random.default_rng(0)
    expected = {}
    processor = TENSOR_PROCESSORS["llama"](config={"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS})
    for name, (hf, kind, rows) in STORED.items():
        stored = quantize(rng.standard_normal((rows, HIDDEN), dtype=np.float32) * 0.02, kind)
        writer.add_tensor(f"{name}.weight", stored, raw_dtype=gguf.GGMLQuantizationType[kind])
        oracle = gguf.quants.dequantize(stored, gguf.GGMLQuantizationType[kind])
        expected[f"{hf}.weight"] = processor.process(weights=oracle, name=f"{name}.weight").weights
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = SimpleNamespace(num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS)
    return GGUFTensors(path, config), expected


def test_each_block_type_decodes_to_the_oracles_weights_exactly(blocks_file):
    """In the kernels' forms: int4 w = (q - 8) * scale + zero, int8 groups w = q * scale (Q5_K's:
    + zero), int5 groups (Q5_0, Q5_1) w = q * scale + zero, bit for bit in float32 (the products are exact, so float64 then one rounding is
    the oracle's)."""
    tensors, expected = blocks_file
    for name, want in expected.items():
        kind = tensors.type_of(name)
        if kind in ("Q4_0", "Q4_1", "Q4_K"):
            q, scale, zero = tensors.int4_groups(name)
            assert q.dtype == torch.uint8 and int(q.max()) <= 15 and scale.shape[1] == HIDDEN // 32
            groups = (q.double().view(q.shape[0], -1, 32) - 8) * scale.double()[..., None] + zero.double()[..., None]
        elif kind in ("Q8_0", "Q6_K"):
            q, scale = tensors.int8_groups(name)
            group = {"Q8_0": 32, "Q6_K": 16}[kind]
            assert q.dtype == torch.int8 and scale.shape[1] == HIDDEN // group == HIDDEN // tensors.int8_group(name)
            if kind == "Q6_K":
                assert -32 <= int(q.min()) and int(q.max()) <= 31
            groups = q.double().view(q.shape[0], -1, group) * scale.double()[..., None]
        else:       # Q5_0, Q5_1 (int5 groups), Q5_K (widened: 8-bit groups): groups of 32 with a zero point
            q, scale, zero = (tensors.int8_groups if kind == "Q5_K" else tensors.int5_groups)(name)
            assert q.dtype == torch.uint8 and int(q.max()) <= 31 and scale.shape[1] == HIDDEN // 32 == zero.shape[1]
            assert tensors.int8_group(name) == 32
            groups = q.double().view(q.shape[0], -1, 32) * scale.double()[..., None] + zero.double()[..., None]
        assert torch.equal(groups.view(q.shape).float(), torch.from_numpy(want)), (name, kind)


def test_a_dequantized_read_in_bf16_is_the_oracle_rounded(blocks_file):
    tensors, expected = blocks_file
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(tensors.dequantized(name, torch.bfloat16), torch.from_numpy(expected[name]).to(torch.bfloat16))


def test_our_k_quant_packers_round_to_nearest():
    """The k-quant blocks packed here, decoded by the oracle: each super-block's error within
    its kind's resolution (Q5_K's fifth bit halves Q4_K's; a misplaced high bit would not)."""
    w = np.random.default_rng(1).standard_normal((16, 512), dtype=np.float32) * 0.02
    errors = {}
    for kind, width in (("Q4_K", 144), ("Q5_K", 176), ("Q6_K", 210)):
        blocks = quantize(w, kind)
        assert blocks.shape == (16, 2 * width) and blocks.dtype == np.uint8
        back = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind])
        errors[kind] = float(np.abs(back - w).max() / np.abs(w).max())
    assert errors["Q4_K"] < 0.08 and errors["Q5_K"] < 0.6 * errors["Q4_K"] and errors["Q6_K"] < 0.04, errors


def test_the_q4_k_m_recipe_is_llama_cpps():
    """Qwen3-1.7B's 28 layers: attn_v and ffn_down in Q6_K in the first and last eighth and
    every third layer between; the tied embedding (the head) in Q6_K; the rest Q4_K."""
    config = make_config("qwen3-1.7b")
    more_bits = [i for i in range(28) if use_more_bits(i, 28)]
    assert more_bits == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]
    shape = (1024, 2048)
    assert recipe_type("model.embed_tokens.weight", (151936, 2048), config) == "Q6_K"
    assert [recipe_type(f"model.layers.{i}.self_attn.v_proj.weight", shape, config) for i in (0, 3, 5)] == ["Q6_K", "Q4_K", "Q6_K"]
    assert recipe_type("model.layers.3.mlp.down_proj.weight", (2048, 6144), config) == "Q4_K"
    assert recipe_type("model.layers.4.self_attn.q_proj.weight", (2048, 2048), config) == "Q4_K"
    assert recipe_type("model.layers.4.input_layernorm.weight", (2048,), config) == "F32"
    assert recipe_type("model.layers.0.mlp.down_proj.weight", (2048, 384), config) == "Q8_0"      # fallback


@pytest.fixture(scope="module")
def mix_file(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("mix") / "tiny-q4_k_m.gguf", MIX, "Q4_K_M")


@pytest.fixture(scope="module")
def exact(mix_file):
    """The file dequantized to float32: the reference."""
    return load_model(str(mix_file), dtype=torch.float32, weight_dtype="float")


def _kernels_refuse() -> str | None:
    cpu = torch.device("cpu")
    return (quantized_linear.unsupported(INT4, (HIDDEN, HIDDEN), cpu, torch.bfloat16, 32)
            or quantized_linear.unsupported(INT8_GROUPS, (HIDDEN, HIDDEN), cpu, torch.bfloat16, 16)
            or quantized_linear.unsupported(Q4_K, (HIDDEN, HIDDEN), cpu, torch.bfloat16, 256))


@pytest.fixture(scope="module")
def as_stored(mix_file):
    skip_unless_runs(_kernels_refuse(), "our quantized CPU linear")
    return load_model(str(mix_file), dtype=torch.bfloat16)


def test_our_float_read_of_a_gguf_is_transformers_own(mix_file, exact):
    """Row order (llama's q/k permutation undone), every block type's dequantization and the
    tied head: transformers' GGUF loader gives the same logits."""
    ids = exact.tokenizer.encode(LOGITS_TEXT)
    with torch.no_grad():
        reference = transformers_model(exact.folder).eval()(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(our_logits(exact), reference, atol=1e-4, rtol=1e-4)


def test_every_quantized_tensor_a_kernel_takes_is_served_as_stored(as_stored):
    report = as_stored.weights.as_dict()
    assert report["served"] == {"Q4_K": "Q4_K super-blocks as stored", "Q6_K": "Q6_K super-blocks as stored",
                                "Q8_0": "int8 as stored (group 32)", "Q5_0": "int5 as stored (group 32)"}
    assert (report["quantized_linears"], report["linears"]) == (4 * 4 + 1, 4 * 4 + 1)     # the Q5_0 downs too
    for i, layer in enumerate(as_stored.model.layers):
        for name, m in layer.named_modules():
            if isinstance(m, Linear):
                assert m.quant is not None and m.weight.is_meta, (i, name)
    assert [layer.mlp.down_proj.quant.describe() for layer in as_stored.model.layers[:2]] == ["int5 (group 32)"] * 2
    head = as_stored.model.lm_head
    # the tied embedding's rows are looked up in the head's stored bytes: no float table
    embedding = as_stored.model.embed_tokens
    assert head.quant.kind == Q6_K and embedding.weight.is_meta and embedding.rows_from is head.quant


def test_a_token_reads_the_files_bytes_of_each_k_quant(mix_file, as_stored):
    """Super-blocks read as stored: the bytes a token reads of each quantized linear are the
    file's bytes of its tensors (the tied Q6_K head whole), not half as many again."""
    from engine.loading.gguf_tensors import read_header
    from engine.speculative.step_costs import weight_bytes_per_token
    _, tensors = read_header(mix_file)
    k_quants = sum(t.n_bytes for t in tensors if t.tensor_type.name in ("Q4_K", "Q6_K"))
    parts = [part for m in as_stored.model.modules() if getattr(m, "quant", None) is not None
             for part in getattr(m.quant, "parts", [m.quant])]
    assert sum(p.nbytes for p in parts if p.kind in quantized_linear.KQUANTS) == k_quants
    floats = sum(p.numel() * p.element_size() for p in as_stored.model.parameters() if not p.is_meta)
    row = HIDDEN * torch.bfloat16.itemsize        # the embedding row a token looks up
    assert weight_bytes_per_token(as_stored.model) == sum(p.nbytes for p in parts) + floats + row


def test_a_refused_k_quant_kernel_serves_the_widened_forms_with_the_same_logits(mix_file, as_stored, monkeypatch):
    """Where the K-quant kernel refuses (a trial failed), Q4_K is served in int4 groups and Q6_K
    in 8-bit groups of 16, exactly the same weights: the logits agree with the super-blocks' to
    the rounding of d * sc * x against (d * sc) rounded into a widened scale."""
    from engine.kernels import cpu_kquant
    monkeypatch.setattr(cpu_kquant, "refusal", lambda: "a trial failed (forced)")
    widened = load_model(str(mix_file), dtype=torch.bfloat16)
    assert widened.weights.as_dict()["served"]["Q4_K"] == "int4 groups of 32, widened"
    assert widened.weights.as_dict()["served"]["Q6_K"] == "int8 groups of 16, widened"
    assert widened.model.lm_head.quant.kind == INT8_GROUPS
    a, b = our_logits(widened).float(), our_logits(as_stored).float()
    assert (a - b).abs().max() <= 2e-2 * b.abs().max()


def test_a_fused_linear_of_mixed_types_runs_each_part_in_its_kernel(as_stored, exact):
    """Layers 2 and 3 store q, k in Q4_K and v in Q6_K: one Q4_K weight for q and k, a Q6_K one
    for v, stacked; together they compute the file's weights."""
    for i in (2, 3):
        qkv = as_stored.model.layers[i].self_attn.qkv_proj
        parts = qkv.quant.parts
        assert [p.kind for p in parts] == [Q4_K, Q6_K] and [p.shape[0] for p in parts] == [HIDDEN + 128, 128]
        want = exact.model.layers[i].self_attn.qkv_proj.dense_weight()
        assert (quantized_linear.dequantize(qkv.quant).float() - want).abs().max() <= 1e-2 * want.abs().max()
    assert not hasattr(as_stored.model.layers[0].self_attn.qkv_proj.quant, "parts")     # all Q4_K: one weight


def test_served_as_stored_logits_stay_as_close_to_exact_as_bf16(mix_file, as_stored, exact):
    """The kernels may round activations to int8 per 32: as stored is held to twice the error
    of the dequantized bf16 model against the file's exact weights."""
    reference = our_logits(exact).float()
    bf16 = load_model(str(mix_file), dtype=torch.bfloat16, weight_dtype="float")
    err_stored = (our_logits(as_stored).float() - reference).abs().max()
    err_bf16 = (our_logits(bf16).float() - reference).abs().max()
    assert err_stored <= 2 * err_bf16 + 1e-3 * reference.abs().max(), (float(err_stored), float(err_bf16))


def test_a_tensor_served_as_stored_is_never_read_in_float(mix_file, monkeypatch):
    """Only the norms are dequantized at load (and the last down projection's first row and every
    997th embedding row, for the weights' fingerprint, which a draft head checks:
    engine.models.eagle_head); every other tensor goes from its blocks to its kernel, the Q5_0
    downs and the embedding's lookups included."""
    skip_unless_runs(_kernels_refuse(), "our quantized CPU linear")
    read = []
    original = GGUFTensors.dequantized
    monkeypatch.setattr(GGUFTensors, "dequantized", lambda self, name, dtype=torch.float32, rows=slice(None):
                        read.append(name if rows == slice(None) else f"{name}[{rows.start}:{rows.stop}:{rows.step}]")
                        or original(self, name, dtype, rows))
    loaded = load_model(str(mix_file), dtype=torch.bfloat16)
    assert loaded.weights.quantized == 17
    assert sorted(n for n in read if not n.endswith("norm.weight")) == [
        "model.embed_tokens.weight[None:None:997]", "model.layers.3.mlp.down_proj.weight[0:1:None]"]


def test_a_large_tensor_is_packed_in_slices_of_rows_with_the_same_results(mix_file, as_stored, monkeypatch):
    """The tied head packed a slice of rows at a time (bounded load memory), the slices joined
    into one weight: the same logits, bit for bit, as packed whole."""
    from engine.loading import weight_quant
    monkeypatch.setattr(weight_quant, "PART_VALUES", 2**20)
    asked = _rows_asked(monkeypatch)
    sliced = load_model(str(mix_file), dtype=torch.bfloat16)
    head = sliced.model.lm_head.quant
    assert asked["model.embed_tokens.weight"] == [(i * 4096, (i + 1) * 4096) for i in range(12)]
    assert head.kind == Q6_K and head.shape == (12 * 4096, HIDDEN)          # one weight, one kernel call
    assert torch.equal(our_logits(sliced), our_logits(as_stored))


def test_a_fused_linear_larger_than_a_slice_is_packed_part_by_part_with_the_same_results(mix_file, as_stored,
                                                                                        monkeypatch):
    """A fused linear of several stored parts of one form larger than a slice (an 8B's gate/up:
    2 x 12288 x 4096 values) is cut part by part, each part into slices of its own rows (issue
    62: each slice was asked of every part, past a part's end), and joined again into one
    weight. The same logits, bit for bit."""
    from engine.loading import weight_quant
    monkeypatch.setattr(weight_quant, "PART_VALUES", 2**16)        # 256 rows of 256: every fused run is cut
    asked = _rows_asked(monkeypatch)
    sliced = load_model(str(mix_file), dtype=torch.bfloat16)
    for part in ("gate_proj", "up_proj"):
        assert asked[f"model.layers.0.mlp.{part}.weight"] == [(0, 256), (256, 384)]
    assert [asked[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"] == [[(None, None)]] * 3
    mlp, attn = sliced.model.layers[0].mlp, sliced.model.layers[0].self_attn
    assert mlp.gate_up_proj.quant.shape == (768, HIDDEN) and not hasattr(mlp.gate_up_proj.quant, "parts")
    assert attn.qkv_proj.quant.shape == (HEADS * HEAD_DIM + 2 * KV_HEADS * HEAD_DIM, HIDDEN)
    assert torch.equal(our_logits(sliced), our_logits(as_stored))


def _rows_asked(monkeypatch) -> dict[str, list[tuple]]:
    """Per tensor, the (start, stop) of each slice of rows its stored blocks were asked for."""
    asked: dict[str, list[tuple]] = {}
    for method in ("blocks", "int4_groups", "int8_groups"):
        original = getattr(GGUFTensors, method)

        def spy(self, name, rows=slice(None), original=original):
            asked.setdefault(name, []).append((rows.start, rows.stop))
            return original(self, name, rows)
        monkeypatch.setattr(GGUFTensors, method, spy)
    return asked


def test_an_untied_embedding_is_looked_up_in_its_stored_blocks_with_the_same_logits(tmp_path, monkeypatch):
    """An embedding no head shares (an 8B's) is never held as a float table: its rows come from
    its stored Q4_K blocks (read once, as the file holds them), and the logits are bit for bit
    those of the table read in float."""
    skip_unless_runs(_kernels_refuse(), "our quantized CPU linear")
    from engine.loading import weight_quant
    path = write_gguf(tmp_path / "untied.gguf", {**MIX, "tie_word_embeddings": False}, "Q4_K_M")
    assert GGUFTensors(path, make_config(MIX)).type_of("model.embed_tokens.weight") == "Q4_K"
    looked_up = load_model(str(path), dtype=torch.bfloat16)
    table = looked_up.model.embed_tokens
    assert table.weight.is_meta and table.rows_from.kind == Q4_K and table.rows_from.shape == tuple(table.weight.shape)
    assert looked_up.weights.embedding == "Q4_K looked up as stored"
    monkeypatch.setattr(weight_quant, "embedding_plan", lambda *args: None)
    held = load_model(str(path), dtype=torch.bfloat16)
    assert not held.model.embed_tokens.weight.is_meta and held.weights.embedding is None
    assert torch.equal(our_logits(looked_up), our_logits(held))
    # the memory plan counts the stored blocks the rows come from, not the float table
    from engine.cache.memory_plan import weights_bytes
    float_table = held.model.embed_tokens.weight
    assert weights_bytes(looked_up.model) == (weights_bytes(held.model) - float_table.numel() * float_table.element_size()
                                              + table.rows_from.nbytes)


def test_a_load_shows_its_progress_through_the_weights_read_as_stored(mix_file):
    """The weights read as stored are nearly all of a quantized file's bytes (an 8B's 5 GB):
    the progress bar moves as each is packed, never backwards, and reaches the weights' end."""
    from engine.loading.loader import WEIGHTS_END
    skip_unless_runs(_kernels_refuse(), "our quantized CPU linear")
    seen = []
    loaded = load_model(str(mix_file), dtype=torch.bfloat16, progress=lambda message, fraction: seen.append((message, fraction)))
    fractions = [f for _, f in seen]
    assert fractions == sorted(fractions) and seen[-1] == ("model ready", 1.0)
    as_stored = [f for m, f in seen if m.startswith("reading ") and m.endswith(" as stored")]
    assert len(as_stored) == loaded.weights.quantized == 17
    assert as_stored[-1] == pytest.approx(WEIGHTS_END) and as_stored[0] < as_stored[-1]


def test_the_header_is_read_as_gguf_reads_it(mix_file):
    """Our header parse (which skips the tokenizer's arrays) finds every tensor where gguf's
    reader does."""
    from engine.loading.gguf_tensors import read_header
    metadata, tensors = read_header(mix_file)
    reader = gguf.GGUFReader(str(mix_file))
    assert metadata["general.architecture"] == "llama" and metadata["llama.block_count"] == 4
    assert [(t.name, t.tensor_type, t.shape, t.n_bytes, t.data_offset) for t in tensors] == [
        (t.name, t.tensor_type, tuple(int(n) for n in t.shape), int(t.n_bytes), int(t.data_offset)) for t in reader.tensors]


def test_bench_load_measures_a_gguf_against_its_file_size(mix_file):
    """`bench load` on a GGUF: peak RSS against the file's size, and how each stored type is
    served (Q5_0 too: every quantized tensor as stored)."""
    from engine.bench.load import RSS_FACTOR, RSS_SLACK, run_load_bench
    result = run_load_bench(str(mix_file), None, "cpu", None)
    assert result["gguf"] and result["dtype"] == "bfloat16" and result["file_bytes"] == mix_file.stat().st_size
    assert result["rss_target_basis"] == "file_bytes"
    assert result["rss_target_bytes"] == int(RSS_FACTOR * result["file_bytes"] + RSS_SLACK)
    assert result["stored_types"] == ["Q4_K", "Q5_0", "Q6_K", "Q8_0"]
    assert result["weights"]["served"]["Q4_K"] == "Q4_K super-blocks as stored" or excused(_kernels_refuse(), "our quantized CPU linear")
    assert result["all_quantized_as_stored"] is (not _kernels_refuse())       # Q5_0 too
