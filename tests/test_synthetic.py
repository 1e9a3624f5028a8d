"""Random-weight checkpoints (engine.loading.synthetic): a folder transformers and our loader both
read, with the same logits; sharding changes the files, not the weights."""
import json

import pytest
import torch
from safetensors import safe_open

from engine.loading.loader import load_model
from engine.loading.synthetic import INDEX_NAME, main, make_config, tensor_groups, write_checkpoint
from tests.conftest import our_logits, transformers_logits



@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3"])
def test_tiny_checkpoint_gives_transformers_logits(tmp_path, preset):
    folder = write_checkpoint(tmp_path, preset, dtype=torch.float32, seed=1)
    ours, reference = our_logits(load_model(str(folder))), transformers_logits(folder)
    assert ours.shape == reference.shape == (ours.shape[0], 49152)
    assert (ours - reference).abs().max() < 1e-4
    assert reference.std() > 0.05                  # random weights, not zeros: the comparison means something


def test_a_sharded_write_holds_the_same_weights(tmp_path):
    whole = write_checkpoint(tmp_path / "whole", "tiny", seed=2)
    sharded = write_checkpoint(tmp_path / "sharded", "tiny", seed=2, max_shard_bytes=1)
    shards = sorted(sharded.glob("*.safetensors"))
    assert [p.name for p in whole.glob("*.safetensors")] == ["model.safetensors"]
    assert len(shards) >= 3 and not (whole / INDEX_NAME).exists()
    expected = our_logits(load_model(str(whole)))
    assert torch.equal(our_logits(load_model(str(sharded))), expected)
    assert (transformers_logits(sharded) - expected).abs().max() < 1e-4      # transformers follows the index


def test_the_index_names_every_tensor_exactly_once(tmp_path):
    folder = write_checkpoint(tmp_path, "tiny-qwen3", max_shard_bytes=1)
    index = json.loads((folder / INDEX_NAME).read_text())
    found, total = {}, 0
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():
                assert name not in found, f"{name} is in {found.get(name)} and {shard.name}"
                found[name] = shard.name
                t = f.get_tensor(name)
                total += t.numel() * t.element_size()
    assert index["weight_map"] == found
    assert index["metadata"]["total_size"] == total
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                "model.layers.1.self_attn.q_norm.weight", "model.layers.1.mlp.down_proj.weight"}
    assert expected <= set(found) and len(found) == 3 + 2 * 11


def test_norms_are_one_and_weights_look_like_hf_init(tmp_path):
    folder = write_checkpoint(tmp_path, "tiny", dtype=torch.float32)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("model.layers.0.input_layernorm.weight"), torch.ones(64))
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
    assert q.shape == (64, 64) and abs(float(q.std()) - 0.02) < 0.002 and abs(float(q.mean())) < 0.002


def test_the_folder_is_a_complete_model(tmp_path):
    folder = write_checkpoint(tmp_path, "tiny-qwen3")
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"]
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= {p.name for p in folder.iterdir()}
    tokenizer = load_model(str(folder)).tokenizer
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert config["eos_token_id"] == tokenizer.eos_token_id          # generation stops where the tokenizer says


def test_presets_have_the_published_sizes():
    def parameters(preset):
        return sum(t.numel for group in tensor_groups(make_config(preset)) for t in group)
    assert parameters("llama-3.2-1b") == 1_235_814_400                # Llama 3.2 1B (tied head)
    qwen = make_config("qwen3-1.7b")
    non_embedding = parameters("qwen3-1.7b") - qwen.vocab_size * qwen.hidden_size
    assert round(parameters("qwen3-1.7b") / 1e9, 1) == 1.7 and round(non_embedding / 1e9, 1) == 1.4   # model card
    llama = make_config("llama-3.2-1b")
    assert (getattr(llama, "rope_parameters", None) or llama.rope_scaling)["rope_type"] == "llama3"


def test_the_command_line_writes_the_same_checkpoint(tmp_path):
    main(["tiny", str(tmp_path / "cli"), "--dtype", "float32", "--seed", "5"])
    write_checkpoint(tmp_path / "api", "tiny", dtype=torch.float32, seed=5)
    assert (tmp_path / "cli/model.safetensors").read_bytes() == (tmp_path / "api/model.safetensors").read_bytes()
    assert (tmp_path / "cli/config.json").read_text() == (tmp_path / "api/config.json").read_text()


def test_a_folder_with_weights_is_not_overwritten(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"mine")
    with pytest.raises(FileExistsError, match="already holds weights"):
        write_checkpoint(tmp_path, "tiny")
    assert (tmp_path / "model.safetensors").read_bytes() == b"mine"
