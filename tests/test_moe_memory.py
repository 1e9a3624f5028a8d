"""Memory of mixture-of-experts models, told truthfully: `bench memory` on the released shapes
of Qwen3-30B-A3B and gpt-oss-20b (figures checked by hand), the memory plan of a loaded MoE
model (every expert resident; a sliding-window layer's KV counted as a full layer's, since
the cache keeps its blocks), what one token reads, the experts a step wakes, and `bench load`
on a preset cut to the layers that fit."""
import json

import pytest
import torch

from engine import EngineConfig, SamplingParams
from engine.bench import load as load_bench
from engine.bench.model_memory import CARDS, model_memory, quantized_bytes
from engine.cache.memory_plan import GiB, MiB, plan_memory, weights_bytes
from engine.loading.synthetic import make_config, write_checkpoint
from engine.metrics import experts_active_by_batch
from tests.kernels_required import skip_unless_runs

CONTEXT = 32768


@pytest.fixture(scope="module")
def qwen3_30b():
    return model_memory(make_config("qwen3-30b-a3b"), CONTEXT)


@pytest.fixture(scope="module")
def gpt_oss_20b():
    return model_memory(make_config("gpt-oss-20b"), CONTEXT)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from engine.loading.loader import load_model
    return load_model(str(write_checkpoint(tmp_path_factory.mktemp("moe"), "tiny-qwen3-moe")))


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory):
    from engine.loading.loader import load_model
    return load_model(str(write_checkpoint(tmp_path_factory.mktemp("oss"), "tiny-gpt-oss")))


# ---- bench memory on the released shapes ---------------------------------------------
def test_qwen3_30b_a3b_kv_bytes_by_hand(qwen3_30b):
    kv = qwen3_30b["kv"]
    # 48 layers x 4 KV heads x head_dim 128 x (K, V) x 2 bytes
    assert kv["bytes_per_token"]["bf16"] == 48 * 4 * 128 * 2 * 2 == 98_304
    assert kv["bytes_per_sequence"]["bf16"] == 3 * GiB                       # at 32,768 tokens
    # FP8: 1 byte a value, plus one float32 scale per (token, layer, KV head) for K and for V
    assert kv["bytes_per_token"]["fp8_e4m3"] == 48 * 4 * 128 * 2 + 48 * 4 * 2 * 4
    assert kv["window_layers"] == 0 and kv["window_freeing_cache"] is None


def test_qwen3_30b_a3b_parameters_by_hand(qwen3_30b):
    h, vocab, layers, experts, inter = 2048, 151936, 48, 128, 768
    attention = (32 * 128 + 2 * 4 * 128) * h + h * 32 * 128 + 2 * 128    # qkv, o, q/k norms
    expert = 2 * inter * h + h * inter                                   # gate and up, down
    layer = attention + 2 * h + experts * h + experts * expert           # norms, router, experts
    total = 2 * vocab * h + layers * layer + h                           # embedding, head, final norm
    active = total - layers * (experts - 8) * expert                     # 8 of 128 experts a token
    p = qwen3_30b["parameters"]
    assert (p["total"], p["active_per_token"]) == (total, active)
    assert round(total / 1e9, 1) == 30.5 and 3.3e9 < active < 3.4e9      # Qwen: "30.5B, 3.3B activated"
    assert (p["moe_layers"], p["experts_per_layer"], p["experts_per_token"]) == (48, 128, 8)


def test_gpt_oss_20b_window_layers_count_as_full_and_the_freeing_cache_is_shown_apart(gpt_oss_20b):
    kv = gpt_oss_20b["kv"]
    per_layer = 8 * 64 * 2 * 2                                           # 8 KV heads x 64 x (K, V) x bf16
    assert kv["bytes_per_token"]["bf16"] == 24 * per_layer == 49_152    # all 24 layers, window ones too
    assert kv["bytes_per_sequence"]["bf16"] == 1.5 * GiB
    assert (kv["full_layers"], kv["window_layers"], kv["window_tokens"]) == (12, 12, 128)
    freeing = kv["window_freeing_cache"]
    assert "NOT what this engine does" in freeing["note"]
    assert freeing["bytes_per_sequence"]["bf16"] == (12 * CONTEXT + 12 * 128) * per_layer


def test_gpt_oss_20b_parameters_and_mxfp4_as_shipped(gpt_oss_20b):
    p = gpt_oss_20b["parameters"]
    assert round(p["total"] / 1e9, 1) == 20.9                             # OpenAI: 20.9B total
    assert round(p["active_per_token_without_embedding"] / 1e9, 1) == 3.6  # and 3.6B active (no embedding)
    weights = gpt_oss_20b["weights_bytes"]
    # the released checkpoint's files hold 13.76 GB: experts in MXFP4 (4.25 bits), the rest bf16
    assert 13.7e9 < weights["mxfp4"] < 13.8e9
    experts = 24 * 32 * (2 * 2880 * 2880 + 2880 * 2880)
    assert weights["bf16"] - weights["mxfp4"] == 2 * experts - experts * 4.25 / 8
    assert set(gpt_oss_20b["weights_served_on_cuda"]) == {"bf16", "fp8", "int8", "int4", "mxfp4"}
    assert gpt_oss_20b["weights_served_on_cuda"]["bf16"] == "yes"


def test_cards_say_what_fits_after_the_weights_and_a_reserve(qwen3_30b):
    cards = qwen3_30b["cards"]
    weights = qwen3_30b["weights_bytes"]
    assert weights["bf16"] > 48 * GiB                                    # 57 GiB in bf16: on neither card
    for card in CARDS:
        assert not cards[card]["fits"]["bf16_weights_bf16_kv"]["weights_fit"]
    fits = cards["48GiB"]["fits"]
    budget = cards["48GiB"]["budget_after_reserve_bytes"]
    assert budget == int(0.9 * 48 * GiB) - 512 * MiB - cards["activation_reserve_bytes"]
    int4 = fits["int4_weights_bf16_kv"]
    assert int4["tokens"] == (budget - weights["int4"]) // (98_304 * 16) * 16
    assert int4["sequences_at_context"] == int4["tokens"] // CONTEXT >= 1
    assert fits["int4_weights_fp8_e4m3_kv"]["tokens"] > 1.9 * int4["tokens"]      # FP8 KV: ~2x the tokens


def test_quantized_sizes_are_our_kernels_bytes():
    from engine.kernels import cpu_quant
    from engine.layers import quantized_linear
    skip_unless_runs(cpu_quant.refusal(), "our quantized CPU linear")
    w = torch.randn(48, 96)
    assert quantized_linear.quantize_int4(w, torch.bfloat16).nbytes == quantized_bytes(48, 96, "int4")
    assert quantized_linear.quantize_int8(w, torch.bfloat16).nbytes == quantized_bytes(48, 96, "int8")
    assert quantized_bytes(48, 96, "mxfp4") * 8 == 48 * 96 * 4.25


def test_bench_memory_takes_a_preset_name_and_prints_the_model_figures(capsys, monkeypatch):
    from engine.bench import cli, scenarios

    class NoEngine:           # the plan of --model is tested elsewhere; here only --config's figures
        def __init__(self):
            self.target_model = type("T", (), {"display_name": "none"})()
            self.draft_name, self.plan = None, type("P", (), {"as_dict": lambda self: {}})()
    monkeypatch.setattr(scenarios, "_engine", lambda args: NoEngine())
    assert cli.main(["memory", "--config", "qwen3-30b-a3b", "--context", str(CONTEXT), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bytes_per_sequence"]["gqa4_fp16"] == 3 * GiB
    assert out["model"]["kv"]["bytes_per_token"]["bf16"] == 98_304
    assert out["model"]["human"]["weights"]["bf16"] == "56.87 GiB"
    assert out["model"]["parameters"]["human"] == {"total": "30.53 B", "active_per_token": "3.35 B",
                                                   "active_per_token_without_embedding": "3.04 B"}


# ---- the memory plan and the engine on a loaded MoE model -------------------------------
def test_the_plan_counts_every_expert_and_window_layers_as_full(tiny_gpt_oss):
    model = tiny_gpt_oss.model
    plan = plan_memory(EngineConfig(kv_cache_bytes=8 * MiB), torch.device("cpu"), model)
    experts = sum(p.numel() * p.element_size() for layer in model.layers for p in layer.mlp.experts.parameters())
    assert plan.weights_bytes == weights_bytes(model) == sum(p.numel() * p.element_size() for p in model.parameters())
    shape = model.cache_shape                       # one window layer, one full: both cached for every token
    assert shape.num_layers == 2 and [layer.self_attn.window for layer in model.layers] == [8, 0]
    assert plan.kv_bytes_per_block == 16 * 2 * 2 * 2 * 16 * 4      # 16 tokens x 2 layers x K,V x 2 heads x 16 x fp32
    d = plan.as_dict()
    assert d["moe"]["expert_weights_bytes"] == experts and d["moe"]["experts_resident"].startswith("all")
    assert (d["kv_layers"]["full"], d["kv_layers"]["window"], d["kv_layers"]["window_tokens"]) == (1, 1, 8)
    assert "a window layer's KV bytes equal a full layer's" in d["kv_layers"]["window_layers_cached"]


def test_a_token_reads_the_dense_part_and_top_k_experts(tiny_moe):
    from engine.engine import LLMEngine
    eng = LLMEngine(tiny_moe, EngineConfig(kv_cache_bytes=8 * MiB, compile="off"), torch.device("cpu"))
    moe = eng.settings()["moe"]
    model = tiny_moe.model                                        # untied, float: every byte a parameter's
    every = sum(p.numel() * p.element_size() for p in model.parameters())
    table = model.embed_tokens.weight
    experts = moe["expert_weights_bytes"]
    assert experts == sum(p.numel() * p.element_size() for layer in model.layers
                          for p in layer.mlp.experts.parameters())
    assert (moe["experts"], moe["top_k"], moe["moe_layers"]) == (8, 2, 2)
    assert moe["expert_bytes_per_token"] == experts * 2 // 8
    one_row = table.shape[1] * table.element_size()               # the embedding: one row looked up
    assert moe["bytes_read_per_token"] == every - table.numel() * table.element_size() + one_row - experts + experts * 2 // 8
    assert eng.settings()["weight_bytes_per_token"] == moe["bytes_read_per_token"]


def test_a_one_token_step_wakes_top_k_experts_and_a_batch_wakes_more(tiny_moe):
    from engine.engine import LLMEngine
    eng = LLMEngine(tiny_moe, EngineConfig(kv_cache_bytes=8 * MiB, compile="off", max_num_seqs=8), torch.device("cpu"))
    for i in range(6):
        eng.submit(list(range(100 + 7 * i, 110 + 7 * i)), SamplingParams(max_tokens=6, stop_on_eos=False))
    steps = []
    while eng.has_work:
        eng.step()
        steps.append(eng.last_step.as_dict())
    prefill = [s for s in steps if s["prefill_tokens"]]
    assert all(2 < s["experts_active"] <= 8 for s in prefill)               # 60 tokens x 2 picks: most of 8
    by_batch = experts_active_by_batch(steps)
    assert by_batch[6]["experts_active"] > by_batch.get(1, {"experts_active": 2.0})["experts_active"]
    single = LLMEngine(tiny_moe, EngineConfig(kv_cache_bytes=8 * MiB, compile="off"), torch.device("cpu"))
    decode = [e.engine_step for e in single.generate([5, 6, 7], SamplingParams(max_tokens=4, stop_on_eos=False))][1:]
    assert [d["experts_active"] for d in decode] == [2.0] * len(decode)    # one token: exactly its top-2


def test_experts_by_batch_is_the_mean_over_decode_steps_of_each_batch_size():
    steps = [{"batch_size": 1, "prefill_tokens": 0, "experts_active": 2.0},
             {"batch_size": 4, "prefill_tokens": 0, "experts_active": 5.0},
             {"batch_size": 4, "prefill_tokens": 0, "experts_active": 6.0},
             {"batch_size": 4, "prefill_tokens": 30, "experts_active": 8.0},     # a prefill: left out
             {"batch_size": 2, "prefill_tokens": 0, "experts_active": None}]     # a dense model's step
    assert experts_active_by_batch(steps) == {1: {"experts_active": 2.0, "steps": 1},
                                              4: {"experts_active": 5.5, "steps": 2}}


def test_the_app_shows_the_moe_row_and_the_window_layers(tiny_gpt_oss):
    from app.formatting import describe_settings
    from engine.engine import LLMEngine
    eng = LLMEngine(tiny_gpt_oss, EngineConfig(kv_cache_bytes=8 * MiB, compile="off"), torch.device("cpu"))
    lines = describe_settings(eng.settings()).split("<br>")
    [moe] = [line for line in lines if line.startswith("<b>MoE</b>")]
    figures = eng.settings()["moe"]
    assert moe.startswith("<b>MoE</b>: 8 experts in each of 2 layers, 2 active per token; a token reads ")
    assert f"{figures['bytes_read_per_token'] / MiB:.1f} MiB of weights" in moe and "all experts resident" in moe
    [plan] = [line for line in lines if "Memory plan" in line]
    assert plan.endswith("; 1 of 2 layers attend a 8-token window, cached in full like the others "
                         "(the window is a mask)")


# ---- bench load on a preset cut to what fits ---------------------------------------------
def test_the_layers_that_fit_keep_the_rss_target_and_the_page_cache_in_memory(monkeypatch):
    monkeypatch.setattr(load_bench, "available_ram_bytes", lambda: 24 * GiB)
    monkeypatch.setattr(load_bench, "cached_layer_counts", lambda preset: [])
    chosen = load_bench.synthetic_layers("qwen3-30b-a3b", None)
    per_layer, fixed, n = chosen["bytes_per_layer"], chosen["bytes_outside_layers"], chosen["layers"]
    need = lambda layers: 2.3 * (fixed + layers * per_layer) + GiB      # noqa: E731 - RSS 1.3 W + 1 GiB, cache W
    assert need(n) <= 0.8 * 24 * GiB < need(n + 1) and chosen["of"] == 48
    assert chosen["why"].startswith(f"{n} fit: ")
    assert load_bench.synthetic_layers("qwen3-30b-a3b", 2)["layers"] == 2
    assert load_bench.synthetic_layers("tiny-qwen3-moe", None)["why"] == "all of them fit"
    # a cut checkpoint already written is reused when it fits, rather than another one written
    monkeypatch.setattr(load_bench, "cached_layer_counts", lambda preset: [n - 1, n + 1])
    reused = load_bench.synthetic_layers("qwen3-30b-a3b", None)
    assert reused["layers"] == n - 1 and f"the cached {n - 1}-layer checkpoint is reused" in reused["why"]


def test_a_cut_gpt_oss_keeps_its_layer_types_and_its_load_is_measured(tmp_path):
    fields = load_bench.reduced_preset("gpt-oss-20b", 3)
    assert fields["num_hidden_layers"] == 3
    assert fields["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert load_bench.reduced_preset("gpt-oss-20b", 24) == "gpt-oss-20b"
    folder = write_checkpoint(tmp_path, load_bench.reduced_preset("tiny-gpt-oss", 1))
    assert json.loads((folder / "config.json").read_text())["layer_types"] == ["sliding_attention"]
    result = load_bench.run_load_bench(str(folder), None, "cpu", None)
    assert result["peak_rss_bytes"] > result["weight_bytes"] > 0 and result["rss_target_met"]
