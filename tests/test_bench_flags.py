"""Every `python -m engine.bench` scenario runs on the model --model or --synthetic names, or
refuses the flag with a message that says what to do instead (engine.bench.model_flags); none
ignores one. `bench kernels --model F` times F's quantized linears, and the synthetic
Qwen3-8B Q4_K_M preset has the released model's shapes.

The walk stops each scenario where it hands its model to a loader (the places patched below),
so nothing is loaded, written or served here."""
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.bench import cli, model_flags
from engine.errors import ConfigError

FLAGS = {"gguf-file": ["--model"], "float-preset": ["--synthetic", "qwen3-1.7b"],
         "gguf-preset": ["--synthetic", "qwen3-1.7b-q4_k_m"]}
EXTRA = {"agreement": ["--against", "llama.cpp"]}      # what each scenario needs beside the model to start


class Reached(Exception):
    """Raised where a scenario hands its model to a loader: the run stops there, having said which."""

    def __init__(self, where: str, model):
        super().__init__(f"{where} got {model!r}")
        self.where, self.model = where, None if model is None else str(model)


@pytest.fixture
def loaders(monkeypatch, tmp_path):
    """Every place a scenario hands over its model raises Reached; --synthetic's checkpoint is a
    path under tmp_path (never written)."""
    from engine import LLMEngine
    from engine.bench import kl_divergence, load, peer, scenarios, serve_remote
    from engine.loading import loader
    from engine.remote import backend, vllm_venv

    def stop(where, index=0):
        def raise_reached(*args, **kwargs):
            raise Reached(where, args[index] if len(args) > index else kwargs.get("model", kwargs.get("reference")))
        return raise_reached
    monkeypatch.setattr(LLMEngine, "load", stop("LLMEngine.load"))
    monkeypatch.setattr(loader, "load_model", stop("load_model"))
    monkeypatch.setattr(peer, "peer_for", stop("peer_for", 1))
    monkeypatch.setattr(load, "_resolve", stop("bench load"))
    monkeypatch.setattr(scenarios, "_config_for", stop("memory's config"))
    monkeypatch.setattr(kl_divergence, "against_llama_cpp", stop("against_llama_cpp"))
    monkeypatch.setattr(serve_remote, "_MessagesSource", stop("the workload's tokenizer"))
    monkeypatch.setattr(backend, "RemoteBackend", lambda *args, **kwargs: SimpleNamespace(close=lambda: None))
    monkeypatch.setattr(vllm_venv, "python", lambda: tmp_path / "python")

    def checkpoint(preset, layers=None):
        return tmp_path / "synthetic" / (f"{preset}.gguf" if model_flags.is_gguf_preset(preset) else preset)
    monkeypatch.setattr(load, "synthetic_checkpoint", checkpoint)
    monkeypatch.setattr(load, "synthetic_layers", lambda preset, layers: None)
    return checkpoint


def flags(kind: str, tmp_path: Path) -> list[str]:
    return FLAGS[kind] + ([str(tmp_path / "named.gguf")] if kind == "gguf-file" else [])


def variants():
    """Each scenario once, and serve and quality also in their modes against a server."""
    out = [(name, []) for name in cli.SCENARIOS]
    out += [("serve", ["--backend", "http://127.0.0.1:1", "--prompt-set", "random"]),
            ("quality", ["--against", "llama.cpp"])]
    return out


def test_every_scenario_of_the_command_line_has_a_rule():
    assert set(model_flags.RULES) == set(cli.SCENARIOS)
    args = cli.parser().parse_args(["parity"])
    with pytest.raises(LookupError, match="no rule for the scenario 'new-scenario'"):
        model_flags.model_source("new-scenario", args)


@pytest.mark.parametrize("kind", FLAGS)
@pytest.mark.parametrize("scenario, mode", variants(), ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_every_scenario_runs_on_the_model_named_or_refuses_the_flag(scenario, mode, kind, loaders, tmp_path, capsys,
                                                                    monkeypatch):
    # gpu-check as on a machine with CUDA, up to its first load; the rest as on one without
    monkeypatch.setattr("torch.cuda.is_available", lambda: scenario == "gpu-check")
    if scenario == "gpu-check":
        monkeypatch.setattr("torch.cuda.get_device_name", lambda *args: "stand-in")
        monkeypatch.setattr("engine.bench.kernels.run_kernel_bench", lambda source=None: {})
    argv = [scenario, *EXTRA.get(scenario, []), *mode, *flags(kind, tmp_path)]
    args = cli.parser().parse_args(argv)
    try:
        source = model_flags.model_source(scenario, args)
    except ConfigError as refusal:
        source = None
        assert str(refusal).startswith(f"{scenario} does not take {' '.join(flags(kind, tmp_path))}: ")
        assert "use " in str(refusal) or "pass " in str(refusal) or "drop " in str(refusal)

    try:
        code = cli.main(argv)
    except Reached as reached:
        assert source is not None, f"{scenario} refused {kind} but loaded {reached.model}"
        expected = source.model or str(loaders(source.synthetic))
        assert reached.model == expected, f"{scenario} with {argv[1:]} handed {reached} to its loader"
        return
    said = capsys.readouterr().err
    assert source is None, f"{scenario} took {kind} but ran without handing it to a loader: {said}"
    assert code == 2 and f"does not take {FLAGS[kind][0]}" in said


def test_the_issues_cases(loaders, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    # peer against vLLM serves the float preset's checkpoint on both sides
    with pytest.raises(Reached) as reached:
        cli.main(["peer", "--engine", "vllm", "--synthetic", "qwen3-1.7b"])
    assert reached.value.model == str(loaders("qwen3-1.7b"))
    # llama-server reads only GGUF: the float preset is refused, naming the GGUF presets
    assert cli.main(["peer", "--synthetic", "qwen3-1.7b"]) == 2
    said = capsys.readouterr().err
    assert "peer does not take --synthetic qwen3-1.7b" in said and "qwen3-1.7b-q4_k_m" in said
    assert "--engine vllm" in said
    # kernels times the file named
    with pytest.raises(Reached) as reached:
        cli.main(["kernels", "--model", str(tmp_path / "f.gguf"), "--json"])
    assert (reached.value.where, reached.value.model) == ("load_model", str(tmp_path / "f.gguf"))


def test_refusals_come_before_anything_runs(loaders, tmp_path, capsys):
    named = str(tmp_path / "named.gguf")
    # all: peer (llama-server) refuses the float preset, so nothing runs (parity would load first)
    assert cli.main(["all", "--synthetic", "qwen3-1.7b"]) == 2
    assert "does not take --synthetic qwen3-1.7b" in capsys.readouterr().err
    assert cli.main(["parity", "--model", named, "--synthetic", "qwen3-1.7b"]) == 2
    assert "both name the model to run on; give one" in capsys.readouterr().err
    assert cli.main(["parity", "--layers", "4"]) == 2
    assert "parity does not take --layers 4: only load reads it" in capsys.readouterr().err
    assert cli.main(["load", "--synthetic", "qwen3-1.7b-q4_k_m", "--layers", "4"]) == 2
    assert "a GGUF, written whole" in capsys.readouterr().err
    # against a server, --model only makes prompts: refused where the workload makes none
    assert cli.main(["serve", "--backend", "http://127.0.0.1:1", "--model", named]) == 2
    assert "this workload uses neither; drop --model" in capsys.readouterr().err


# ---- bench kernels on a file -----------------------------------------------------------------
def test_kernels_times_the_named_files_linears_against_the_best_read(tmp_path):
    """A 2-layer Q4_K_M file with an untied Q6_K head: one row's pass over every weight the file
    stores quantized (all but the embedding, which is looked up), against the best of the
    bandwidth reads; and each stored type's kernel alone, against plain reads on one and on all
    threads."""
    import math

    import gguf
    import torch
    from engine.bench.linear_rows import READS, linear_rows_bench
    from engine.loading.synthetic_gguf import write_gguf
    shapes = {"preset": "tiny", "hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 2}
    path = write_gguf(tmp_path / "two-layers-q4_k_m.gguf", shapes, "Q4_K_M")
    out = linear_rows_bench(model_flags.ModelSource(str(path), None), repeats=1, type_rounds=1,
                            in_cache_shape=(256, 512), stream_shape=(512, 1024))
    assert (out["model"], out["model_path"]) == (str(path), str(path))
    tensors = gguf.GGUFReader(str(path)).tensors
    head = next(int(t.n_bytes) for t in tensors if t.name == "output.weight")
    stored = sum(int(t.n_bytes) for t in tensors if t.tensor_type.name != "F32" and t.name != "token_embd.weight")
    assert (out["all_linears_bytes"], out["bytes"]) == (stored, stored - head)
    assert out["all_linears"] == out["linears"] + 1
    assert len(out["read_bandwidth_reads_gb_s"]) == 2 * READS + out["repeats"]      # and one each timed round
    assert out["read_bandwidth_best_gb_s"] == max(out["read_bandwidth_reads_gb_s"])
    share = out["all_linears_bytes"] / (out["all_linears_1_row_ms"] * 1e-3) / (out["read_bandwidth_best_gb_s"] * 1e9)
    assert out["roofline_fraction"] == pytest.approx(share, rel=0.02, abs=1e-3)     # as rounded
    # each stored type the file's linears hold (Q4_K and Q6_K), its kernel on its own
    types = {t.tensor_type.name for t in tensors if t.tensor_type.name != "F32" and t.name != "token_embd.weight"}
    assert set(out["per_type"]) == types
    read_1, read_all = out["read_1_thread_gb_s"]["median"], out["read_all_threads_gb_s"]["median"]
    for rates in out["per_type"].values():
        for name in ("in_cache_1_row_gb_s", "in_cache_16_rows_gb_s", "stream_1_thread_gb_s", "stream_all_threads_gb_s"):
            assert 0 < rates[name] < math.inf
        for ratio, rate, read in (("in_cache_1_row_over_read_1_thread", "in_cache_1_row_gb_s", read_1),
                                  ("stream_1_thread_over_read_1_thread", "stream_1_thread_gb_s", read_1),
                                  ("stream_all_threads_over_read_all_threads", "stream_all_threads_gb_s", read_all)):
            assert rates[ratio] == pytest.approx(rates[rate] / read, abs=1e-3)      # as rounded
    assert 0 < out["read_1_thread_gb_s"]["median"] <= out["read_1_thread_gb_s"]["best"] < math.inf
    assert 0 < out["read_all_threads_gb_s"]["median"] <= out["read_all_threads_gb_s"]["best"] < math.inf
    assert torch.get_num_threads() == out["threads"]        # set to one for the one-thread timings, and back


def test_kernels_refuses_a_model_without_quantized_linears(tiny_model):
    from engine.bench.linear_rows import linear_rows_bench
    with pytest.raises(ConfigError, match="has none here .* --synthetic with a GGUF preset"):
        linear_rows_bench(model_flags.ModelSource(str(tiny_model.folder), None), repeats=1)


# ---- the Qwen3-8B preset -----------------------------------------------------------------------
def test_the_qwen3_8b_preset_has_the_released_shapes_and_q4_k_m_is_about_5_gb():
    import gguf
    import numpy as np
    from engine.loading.synthetic import make_config
    from engine.loading.synthetic_gguf import SYNTHETIC_GGUF_PRESETS, gguf_tensor_specs, recipe_type
    assert SYNTHETIC_GGUF_PRESETS["qwen3-8b-q4_k_m"] == ("qwen3-8b", "Q4_K_M")
    config = make_config("qwen3-8b")
    assert (config.model_type, config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, config.intermediate_size, config.vocab_size,
            config.tie_word_embeddings) == ("qwen3", 4096, 36, 32, 8, 128, 12288, 151936, False)
    types = {s.name: (recipe_type(s.name, s.shape, config, "Q4_K_M"), s.shape) for s in gguf_tensor_specs(config)}
    assert types["lm_head.weight"][0] == "Q6_K" and types["model.embed_tokens.weight"][0] == "Q4_K"   # untied
    assert types["model.layers.3.self_attn.q_proj.weight"][0] == "Q4_K"
    stored = sum(int(np.prod(shape)) // gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][0]
                 * gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][1] for kind, shape in types.values())
    assert 4.8e9 < stored < 5.3e9            # Qwen3-8B-Q4_K_M.gguf is 5.03 GB
