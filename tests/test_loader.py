"""Loading a checkpoint: weights stream tensor by tensor into the target dtype and device,
giving transformers' logits; shards load as one file does; every broken input is a
WorkbenchError that names the file and says what to do, and the engine stays as it was."""
import json
import weakref

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig, SamplingParams
from engine.engine import LLMEngine
from engine.errors import CheckpointError, WorkbenchError
from engine.loading.checkpoint import INDEX_NAME, Checkpoint
from engine.loading.loader import load_model
from engine.loading.synthetic import write_checkpoint
from tests.conftest import our_logits, transformers_logits

SMALL_SHARDS = 200_000          # bytes: the tiny presets come out as several shards
SHORT = SamplingParams(max_tokens=6)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A tiny Llama in fp32, written as several shards with an index."""
    return write_checkpoint(tmp_path_factory.mktemp("sharded"), "tiny", dtype=torch.float32, seed=3,
                            max_shard_bytes=SMALL_SHARDS)


@pytest.fixture
def broken(tmp_path, sharded):
    """A fresh copy of the sharded checkpoint, to break."""
    import shutil
    return shutil.copytree(sharded, tmp_path / "model")


# ---- streaming load ---------------------------------------------------------------
@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3"])
def test_a_streamed_sharded_checkpoint_gives_transformers_logits(tmp_path, preset):
    folder = write_checkpoint(tmp_path, preset, dtype=torch.float32, seed=4, max_shard_bytes=SMALL_SHARDS)
    assert (folder / INDEX_NAME).is_file()
    ours, reference = our_logits(load_model(str(folder))), transformers_logits(folder)
    assert ours.shape == reference.shape
    assert (ours - reference).abs().max() < 1e-4
    assert reference.std() > 0.05               # random weights, not zeros: the comparison means something


def test_a_sharded_checkpoint_loads_the_same_weights_as_one_file(tmp_path, sharded):
    whole = write_checkpoint(tmp_path, "tiny", dtype=torch.float32, seed=3)
    assert len(list(sharded.glob("*.safetensors"))) >= 3 and not (whole / INDEX_NAME).exists()
    a, b = load_model(str(whole)).model.state_dict(), load_model(str(sharded)).model.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_weights_arrive_in_the_requested_dtype_with_their_exact_values(sharded):
    """bf16 from an fp32 file: each value rounded once, q/k/v and gate/up fused, in transformers' layout."""
    loaded = load_model(str(sharded), dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert loaded.model.rotary.cos.dtype == torch.float32            # RoPE tables stay fp32
    files = {}
    for f in sharded.glob("*.safetensors"):
        files |= load_file(str(f))
    layer = loaded.model.layers[1]
    qkv = torch.cat([files[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    gate_up = torch.cat([files[f"model.layers.1.mlp.{p}_proj.weight"] for p in ("gate", "up")])
    assert torch.equal(layer.self_attn.qkv_proj.weight, qkv.to(torch.bfloat16))
    assert torch.equal(layer.mlp.gate_up_proj.weight, gate_up.to(torch.bfloat16))
    assert torch.equal(loaded.model.lm_head.weight, files["lm_head.weight"].to(torch.bfloat16))


def test_tensors_are_read_one_at_a_time_with_progress_per_tensor(sharded, monkeypatch):
    read, alive_at_read = Checkpoint.read, []
    live: list[weakref.ref] = []

    def tracking_read(self, name):
        alive_at_read.append(sum(ref() is not None for ref in live))
        tensor = read(self, name)
        live.append(weakref.ref(tensor))
        return tensor
    monkeypatch.setattr(Checkpoint, "read", tracking_read)
    reports = []
    loaded = load_model(str(sharded), progress=lambda message, fraction: reports.append((message, fraction)))
    assert max(alive_at_read) == 0               # each tensor is dropped before the next is read
    weights = [(m, f) for m, f in reports if m.startswith("loading weights")]
    assert len(weights) == len(loaded.model.weight_sources()) == len(list(loaded.model.parameters()))
    fractions = [f for _, f in reports]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0


# ---- broken inputs: each names the file --------------------------------------------
def test_a_config_that_is_not_json_is_named(broken):
    (broken / "config.json").write_text('{"model_type": "llama", oops')
    with pytest.raises(CheckpointError, match="config.json is not valid JSON") as err:
        load_model(str(broken))
    assert str(broken / "config.json") in str(err.value)


def test_a_config_without_model_type_is_named(broken):
    config = json.loads((broken / "config.json").read_text())
    del config["model_type"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match='config.json has no "model_type"; add the architecture') as err:
        load_model(str(broken))
    assert str(broken / "config.json") in str(err.value)


@pytest.mark.parametrize("damage", ["truncated", "corrupt header"])
def test_a_truncated_or_corrupt_shard_is_named(broken, damage):
    shard = sorted(broken.glob("*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) - 100] if damage == "truncated" else data[:8] + b"{garbage" + data[16:])
    with pytest.raises(CheckpointError, match="is truncated or corrupt .* download or copy it again") as err:
        load_model(str(broken))
    assert str(shard) in str(err.value)


def test_an_index_naming_a_missing_shard_is_named(broken):
    shard = sorted(broken.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{INDEX_NAME} names {shard.name}, which is not in"):
        load_model(str(broken))


def test_a_tensor_whose_shape_does_not_match_the_config_is_named(broken):
    config = json.loads((broken / "config.json").read_text())
    config["intermediate_size"] = 96                       # the files hold 128
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"tensor model.layers.0.mlp.gate_proj.weight has shape \[128, 64\] "
                                              r"but .*config.json implies \[96, 64\]") as err:
        load_model(str(broken))
    index = json.loads((broken / INDEX_NAME).read_text())["weight_map"]
    assert str(broken / index["model.layers.0.mlp.gate_proj.weight"]) in str(err.value)


def test_a_missing_tensor_is_named(broken):
    name = "model.layers.1.mlp.down_proj.weight"
    shard = broken / json.loads((broken / INDEX_NAME).read_text())["weight_map"][name]
    tensors = load_file(str(shard))
    del tensors[name]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"tensor {name} is missing from .*{shard.name}.*incomplete"):
        load_model(str(broken))


def test_a_gguf_file_that_is_not_gguf_is_named(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"<html>404 Not Found</html>")
    with pytest.raises(CheckpointError, match="is not a GGUF file") as err:
        load_model(str(fake))
    assert str(fake) in str(err.value)


def test_a_folder_without_a_tokenizer_is_named(broken):
    (broken / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="has no tokenizer .*copy the tokenizer files") as err:
        load_model(str(broken))
    assert str(broken) in str(err.value)


def test_a_folder_without_a_chat_template_chats_in_plain_text_and_says_so(broken):
    from app.formatting import describe_settings
    (broken / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer_config = json.loads((broken / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    (broken / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    eng = LLMEngine(load_model(str(broken)), EngineConfig(kv_cache_bytes=2**20), torch.device("cpu"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert eng.encode(messages) == eng.tokenizer.encode("System: Be brief.\n\nUser: Hi\n\nAssistant:")
    assert eng.generate_text(messages, SHORT)[1]                # it answers
    assert eng.settings()["chat_template"] is False
    assert "messages are sent as plain text" in describe_settings(eng.settings())


def test_a_broken_draft_leaves_the_engine_as_it_was(make_tiny_engine, broken):
    eng = make_tiny_engine(proposer="draft")
    eng.set_draft_model("self:1")
    before, plan = eng.settings(), eng.plan
    (broken / "config.json").write_text("not json")
    with pytest.raises(WorkbenchError, match="config.json is not valid JSON"):
        eng.set_draft_model(str(broken))
    assert eng.settings() == before and eng.plan == plan
    assert eng.kv_bytes()[1] == plan.kv_pool_bytes                 # both pools are back
    assert eng.generate_text("Hello", SHORT)[2].proposed > 0        # and the old draft still drafts


# ---- the command line ---------------------------------------------------------------
def test_workbench_opens_the_model_and_draft_given_on_the_command_line(qapp, tmp_path, sharded):
    from app.__main__ import build, parse_args
    from engine.profiles import ProfileStore
    args = parse_args(["--model", str(sharded), "--draft", "self:1"])
    workbench = build(store=ProfileStore(tmp_path / "config"), start=False, model=args.model, draft=args.draft)
    try:
        profile = workbench.controller.current_profile()
        assert (workbench.controller.model_reference, profile.draft_model) == (str(sharded), "self:1")
        assert profile.proposer == "draft"                        # a draft given is a draft used
    finally:
        workbench.shutdown(save_session=False)
