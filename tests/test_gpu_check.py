"""`python -m engine.bench gpu-check` stays ready for the day a GPU is at hand: its dry run takes
the whole script through every section on the CPU (tiny models, few tokens; the GPU linear
kernels in the Triton interpreter) and writes what it measured to the folder it is given; the
device script (scripts/gpu_check.sh) asks only for what the bench takes."""
import json
import os
import re
import shlex
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")      # before triton is imported: the linears' kernels on the CPU

import pytest  # noqa: E402

from engine.bench import cli  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("decode", "step", "verify_cost", "long_context")


@pytest.fixture
def bench_cache(tmp_path, monkeypatch):
    """Synthetic checkpoints under tmp_path (the kernels' own builds stay in the user cache)."""
    from engine.loading import loader
    monkeypatch.setattr(loader, "cache_dir", lambda: tmp_path / "cache")
    return tmp_path / "cache"


def test_the_dry_run_takes_the_whole_script_through_on_the_cpu_and_writes_its_folder(bench_cache, tmp_path, capsys):
    out = tmp_path / "results"
    argv = ["gpu-check", "--device", "cpu", "--dry-run", "--compile", "off", "--out", str(out), "--json"]
    assert cli.main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    written = json.loads((out / "gpu_check.json").read_text())
    assert printed == written and written["dry_run"] and not written["cuda"]
    assert set(written["models"]) == {"tiny", "tiny-3-layers"}                # the named model, then the shape
    assert (bench_cache / "synthetic" / "tiny-3-layers" / "config.json").is_file()
    for name, model in written["models"].items():
        failed = {key: value["error"] for key, value in model.items() if isinstance(value, dict) and "error" in value}
        assert not failed and "error" not in model, f"{name}: {failed or model['error']}"
        assert all(f"{name}/{section}" in written["seconds"] for section in ("load",) + SECTIONS)
        users = model["decode"]["users"]
        assert list(users) == ["1", "4", "16"] and users["1"]["vs_one_user"] == 1.0
        # the CPU path is batch-invariant: every request gets its prompt's tokens alone
        assert all(row["requests_with_solo_tokens"] == f"{n}/{n}" for n, row in users.items())
        assert model["step"]["host_ms_per_step"] > 0 and model["step"]["gpu_ms_per_step"] is None   # no GPU here
        assert 0 < model["roofline_fraction"] < 1
        assert list(model["verify_cost"]) == ["1", "2", "4", "8"]
        long = model["long_context"]
        assert long["fp8_e4m3"]["kv_cache_dtype"] == "fp8_e4m3" and long["auto"]["kv_cache_dtype"] == "bfloat16"
        assert long["fp8_e4m3"]["kv_bytes_per_token"] < long["auto"]["kv_bytes_per_token"]
    parity = written["models"]["tiny"]["parity"]
    assert parity["meaningful"] is False and len(parity["greedy_identical"]) == 3   # random weights: said so
    assert "parity" not in written["models"]["tiny-3-layers"]
    linears = written["linears"]
    assert linears["rows"] == [1, 4, 16] and linears["bandwidth_gb_s"] > 0
    assert all(f"tiny-q4_k_m/{part}" in written["seconds"] for part in ("kernel", "decode", "llama_server"))
    tiny = linears["tiny-q4_k_m"]
    kernel = tiny["kernel"]
    assert "error" not in kernel and "skipped" not in kernel, kernel
    # the recipe's Q4_K body and Q6_K head and more-bits layers, each cut to one 64 x 256 weight
    assert kernel["types"] == {"Q4_K": 1, "Q6_K": 1} and kernel["stored_bytes"] == 64 * (144 + 210)
    assert list(kernel["rows"]) == ["1", "4", "16"]
    assert all(row["ms_per_pass"] > 0 and row["stored_gb_s"] > 0 and row["of_bandwidth"] > 0
               for row in kernel["rows"].values())
    assert tiny["decode"]["decode_tok_s"] > 0 and tiny["file"].endswith("tiny")     # the named model stands in
    server = tiny["llama_server"]            # no CUDA here, so no llama-server built for it: said why
    assert server["decode_tok_s"] is None and "not built" in server["not_run"]


def test_the_linears_timed_are_the_files_own(tmp_path, monkeypatch):
    """The linears section times the shapes and types synthetic_gguf's recipe gives a file
    without reading it: they must be the written file's linears, each layer's, then the head
    (here the tied embedding, as in the 1.7B's file)."""
    from engine.bench import gpu
    from engine.loading.gguf_tensors import read_header
    from engine.loading.synthetic_gguf import write_gguf
    preset = {**gpu.TINY_GGUF, "num_hidden_layers": 3, "tie_word_embeddings": True}   # layer 2: Q6_K v and down
    monkeypatch.setitem(gpu.GGUF_RECIPES, "file", (preset, "Q4_K_M"))
    _, tensors = read_header(write_gguf(tmp_path / "file.gguf", preset, "Q4_K_M"))
    stored = [t for t in tensors if t.name.startswith("blk.") and len(t.shape) == 2]
    stored += [t for t in tensors if t.name == "token_embd.weight"]
    linears = gpu.gguf_linears("file")
    assert linears == [(t.tensor_type.name, (int(t.shape[1]), int(t.shape[0]))) for t in stored]
    assert {kind for kind, _ in linears} == {"Q4_K", "Q6_K"} and len(linears) == 3 * 7 + 1


def test_without_cuda_and_without_dry_run_it_says_so(capsys):
    assert cli.main(["gpu-check", "--device", "cpu", "--json"]) == 0
    assert "only --dry-run runs" in json.loads(capsys.readouterr().out)["message"]


def test_dry_run_and_out_are_gpu_checks_alone(capsys):
    assert cli.main(["parity", "--dry-run"]) == 2
    assert "parity does not take --dry-run: only gpu-check reads it; drop it" in capsys.readouterr().err
    assert cli.main(["decode", "--out", "somewhere"]) == 2
    assert "decode does not take --out" in capsys.readouterr().err


def test_the_device_script_asks_the_bench_only_for_what_it_takes():
    """scripts/gpu_check.sh is run once, on a lent machine, by a later session: a flag the bench
    no longer takes would cost that session its device time."""
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    calls = re.findall(r"-m engine\.bench ([^\n>|&]*)", script)
    assert len(calls) >= 2, "the dry run, then the full run"
    for call in calls:
        args = cli.parser().parse_args(["FOLDER" if "$" in word else word for word in shlex.split(call)])
        assert args.scenario == "gpu-check" and args.out == "FOLDER"
