"""A GGUF's weights as a CUDA load holds them, told by `bench memory` without a GPU: each
tensor's file bytes where its type has a CUDA form (engine.loading.stored_formats), bf16 for the
rest; the Qwen3-14B preset and its Q4_K_M on a 24 GiB card; and `--device cuda` on a machine
without CUDA saying the plan was not made instead of failing."""
import json

import pytest
import torch

from engine.bench import cli
from engine.bench.model_memory import (GGUF_AS_STORED, as_stored_on_cuda, gguf_file_tensors, gguf_preset_tensors,
                                       model_memory)
from engine.cache.memory_plan import GiB
from engine.loading.gguf_tensors import read_header
from engine.loading.loader import default_gguf_path
from engine.loading.synthetic import make_config
from engine.loading.synthetic_gguf import SYNTHETIC_GGUF_PRESETS

SERVED_ON_CUDA = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}     # the table's, by hand
CONTEXT = 32768


def test_the_qwen3_14b_preset_has_the_released_shapes():
    config = make_config("qwen3-14b")
    assert (config.model_type, config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, config.intermediate_size, config.vocab_size,
            config.max_position_embeddings, config.rope_parameters["rope_theta"], config.rms_norm_eps,
            config.tie_word_embeddings) == (
        "qwen3", 5120, 40, 40, 8, 128, 17408, 151936, 40960, 1000000.0, 1e-6, False)
    assert SYNTHETIC_GGUF_PRESETS["qwen3-14b-q4_k_m"] == ("qwen3-14b", "Q4_K_M")
    h, vocab, inter = 5120, 151936, 17408
    layer = 2 * h * 40 * 128 + 2 * h * 8 * 128 + 2 * 128 + 3 * h * inter + 2 * h    # q, o; k, v; q/k norms; MLP; norms
    total = 2 * vocab * h + 40 * layer + h
    p = model_memory(config, CONTEXT)["parameters"]
    assert p["total"] == total
    # Qwen's model card: "14.8B, non-embedding 13.2B"
    assert round(total / 1e9, 1) == 14.8 and round((total - 2 * vocab * h) / 1e9, 1) == 13.2


def test_a_real_gguf_is_held_at_its_file_bytes_with_floats_in_bf16():
    """The embedded SmolLM2 (Q4_1, its tied embedding and head Q8_0, norms F32): every quantized
    tensor costs its file bytes, every F32 one 2 bytes a value, the table looked up in the head."""
    path = default_gguf_path()
    _, tensors = read_header(path)
    want = sum(t.n_bytes if t.tensor_type.name in SERVED_ON_CUDA else 2 * t.n_bytes // 4 for t in tensors)
    assert {t.tensor_type.name for t in tensors} == {"Q4_1", "Q8_0", "F32"}
    stored = as_stored_on_cuda(gguf_file_tensors(path), path.stat().st_size)
    assert stored["bytes"] == want
    assert stored["embedding"] == {"type": "Q8_0", "looked_up_as_stored": True, "tied_to_head": True,
                                   "bytes": next(t.n_bytes for t in tensors if t.name == "token_embd.weight")}
    assert stored["weights_to_file"] <= 1.05 and stored["file_bytes"] == path.stat().st_size


def test_an_untied_embedding_is_bf16_where_a_linear_is_not_served_as_stored():
    """Qwen3-MoE's routers stay F32 in a Q4_K_M file, so not every linear is served as stored
    and the Q4_K table is held in bf16 (engine.loading.weight_quant.embedding_plan)."""
    tensors = gguf_preset_tensors("tiny-qwen3-moe-q4_k_m")
    table = next(t for t in tensors if t.name == "token_embd.weight")
    stored = as_stored_on_cuda(tensors)
    assert table.kind == "Q4_K" and any(t.kind == "F32" and t.is_linear for t in tensors)
    assert stored["embedding"]["bytes"] == 2 * table.values and not stored["embedding"]["looked_up_as_stored"]


def test_qwen3_14b_q4_k_m_as_stored_fits_24_gib_with_a_32k_sequence_in_fp8():
    """Counted from the preset's recipe, no file written: about the released 9.0 GB file; bf16
    weights (27.5 GiB) do not fit the card at all."""
    figures = model_memory(make_config("qwen3-14b"), CONTEXT, gguf_preset_tensors("qwen3-14b-q4_k_m"))
    stored = figures[GGUF_AS_STORED]
    assert 8.5e9 < stored["bytes"] <= stored["file_tensor_bytes"] < 9.3e9
    fits = figures["cards"]["24GiB"]["fits"]
    assert fits[f"{GGUF_AS_STORED}_weights_fp8_e4m3_kv"]["sequences_at_context"] >= 1
    assert fits[f"{GGUF_AS_STORED}_weights_fp8_e4m3_kv"]["tokens"] >= CONTEXT
    assert not fits["bf16_weights_fp8_e4m3_kv"]["weights_fit"]
    assert figures["weights_bytes"][GGUF_AS_STORED] == stored["bytes"] < 9.3e9 < 24 * GiB


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the engine makes its plan on the device")
def test_bench_memory_on_cuda_without_a_device_says_the_plan_was_not_made(capsys):
    path = default_gguf_path()
    assert cli.main(["memory", "--device", "cuda", "--model", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    plan = out["plan"]
    assert plan["made"] is False and "not planned: no CUDA device here" in plan["why"]
    assert plan["weights_bytes"] == out["model"][GGUF_AS_STORED]["bytes"]
    assert plan["file_bytes"] == path.stat().st_size and plan["weights_to_file"] <= 1.05
    assert out["model"]["cards"]["24GiB"]["fits"][f"{GGUF_AS_STORED}_weights_fp8_e4m3_kv"]["weights_fit"]
