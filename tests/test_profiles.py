"""Session profiles: versioned JSON round trip, atomic writes, clear errors, built-ins."""
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from engine.errors import WorkbenchError
from engine.profiles import (FORMAT, VERSION, ProfileError, ProfileStore, SessionProfile, builtin_profiles,
                             read_profile)

CUSTOM = SessionProfile(name="mine", model="/models/qwen", draft_model="self", proposer="draft",
                        num_speculative_tokens=7, kv_cache_dtype="fp8_e4m3", enable_prefix_caching=False,
                        block_size=32, max_tokens=64, temperature=0.7, top_p=0.9, top_k=40, seed=123,
                        system_prompt="Be terse.")


@pytest.fixture
def store(tmp_path):
    return ProfileStore(tmp_path)


def test_every_setting_survives_save_and_load(store):
    path = store.save(CUSTOM)
    assert path == store.profiles_dir / "mine.json"
    assert store.load("mine") == CUSTOM
    data = json.loads(path.read_text())
    assert data["format"] == FORMAT and data["version"] == VERSION == 4


def test_save_as_writes_a_second_name_and_both_are_listed(store):
    store.save(CUSTOM)
    store.save(CUSTOM, name="copy of mine")
    assert store.names() == ["copy of mine", "mine"]
    assert store.load("copy of mine").name == "copy of mine"


def test_profile_maps_onto_engine_config_and_sampling():
    config = CUSTOM.engine_config()
    assert (config.kv_cache_dtype, config.block_size, config.enable_prefix_caching) == ("fp8_e4m3", 32, False)
    assert (config.proposer, config.num_speculative_tokens, config.draft_model) == ("draft", 7, "self")
    params = CUSTOM.sampling_params()
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed) == (64, 0.7, 0.9, 40, 123)
    assert CUSTOM.engine_settings() == {"kv_cache_dtype": "fp8_e4m3", "block_size": 32, "enable_prefix_caching": False,
                                        "proposer": "draft", "num_speculative_tokens": 7, "draft_model": "self", "eagle_head": None,
                                        "speculation_policy": "auto", "draft_tree": "off", "ngram_min": 1, "ngram_max": 4,
                                        "suffix_spec_factor": 1.0, "suffix_min_prob": 0.1, "suffix_cache_tokens": 1 << 18,
                                        "kv_cache_bytes": None, "num_blocks": None, "attention_backend": "auto",
                                        "compile": "auto", "max_num_seqs": None, "max_num_batched_tokens": None}


def test_a_version_1_profile_reads_with_the_newer_settings_at_their_defaults(tmp_path):
    v1 = {"format": FORMAT, "version": 1, "name": "old", "model": "default", "draft_model": None,
          "proposer": "ngram", "num_speculative_tokens": 3, "kv_cache_dtype": "fp8_e4m3",
          "enable_prefix_caching": False, "block_size": 16, "max_tokens": 64, "temperature": 0.5, "top_p": 1,
          "top_k": 0, "seed": None, "system_prompt": "Hi."}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(v1))
    profile = read_profile(path)
    assert (profile.proposer, profile.num_speculative_tokens, profile.top_p) == ("ngram", 3, 1.0)
    assert (profile.ngram_min, profile.ngram_max, profile.attention_backend) == (1, 4, "auto")
    assert profile.to_json_dict()["version"] == VERSION


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    ('{"format": "something-else", "version": 1}', "not an inference-workbench profile"),
    (json.dumps({"format": FORMAT, "version": VERSION + 1}), "newer workbench"),
    (json.dumps({"format": FORMAT, "version": 1, "num_speculative_tokens": 99}), "1..16"),
    (json.dumps({"format": FORMAT, "version": 1, "temprature": 0.5}), "unknown settings ['temprature']"),
    (json.dumps({"format": FORMAT, "version": 1, "enable_prefix_caching": "yes"}), "enable_prefix_caching must be bool"),
    (json.dumps({"format": FORMAT, "version": 1, "max_tokens": True}), "max_tokens must be int"),
])
def test_a_bad_file_raises_a_clear_error_and_changes_nothing(store, content, message):
    store.save(CUSTOM)
    before = store.load("mine")
    bad = store.profiles_dir / "bad.json"
    bad.write_text(content)
    with pytest.raises(ProfileError, match=message.replace("[", r"\[").replace("]", r"\]")) as info:
        store.load("bad")
    assert isinstance(info.value, WorkbenchError)
    assert str(bad) in str(info.value)
    assert store.load("mine") == before
    assert bad.read_text() == content


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp_files(store, monkeypatch):
    store.save(CUSTOM)
    original = store.path_for("mine").read_text()

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(ProfileError, match="No space left"):
        store.save(SessionProfile(name="mine", temperature=1.0))
    assert store.path_for("mine").read_text() == original
    assert [p.name for p in store.profiles_dir.iterdir()] == ["mine.json"]


def test_names_that_would_escape_the_folder_are_refused(store):
    for name in ("../evil", "a/b", "", ".hidden"):
        with pytest.raises(ProfileError, match="not a usable profile name"):
            store.save(CUSTOM, name=name)


def test_delete_removes_the_file_and_its_recent_entry(store):
    store.save(CUSTOM)
    store.save(CUSTOM, name="other")
    store.delete("mine")
    assert store.names() == ["other"]
    assert [p.name for p in store.recent()] == ["other.json"]
    with pytest.raises(ProfileError, match="no profile named 'mine'"):
        store.delete("mine")


def test_recent_lists_newest_first_without_duplicates(store):
    for name in ("a", "b", "c"):
        store.save(SessionProfile(name=name))
    store.load("a")
    assert [p.stem for p in store.recent()] == ["a", "c", "b"]


def test_builtin_profiles_hold_the_baseline_and_all_optimizations():
    builtins = builtin_profiles()
    baseline = read_profile(builtins["baseline"])
    assert (baseline.proposer, baseline.kv_cache_dtype, baseline.enable_prefix_caching) == ("off", "auto", False)
    best = read_profile(builtins["all_optimizations"])
    assert best.proposer == "auto" and best.num_speculative_tokens == 4     # the proposer that pays, measured
    assert (best.kv_cache_dtype, best.enable_prefix_caching) == ("fp8_when_short", True)   # FP8 where it pays


def test_builtins_load_by_name_unless_the_user_saved_one_with_that_name(store):
    assert store.load("baseline").enable_prefix_caching is False
    store.save(SessionProfile(name="baseline", enable_prefix_caching=True))
    assert store.load("baseline").enable_prefix_caching is True


def test_last_session_restores_and_a_broken_one_falls_back_with_a_warning(store):
    assert store.startup_profile() == (SessionProfile(), None)
    store.save_last_session(CUSTOM)
    profile, warning = store.startup_profile()
    assert warning is None and profile.kv_cache_dtype == "fp8_e4m3" and profile.seed == 123
    (store.root / "last_session.json").write_text("]")
    profile, warning = store.startup_profile()
    assert profile == SessionProfile() and "not valid JSON" in warning


def test_startup_from_an_explicit_profile_path(store, tmp_path):
    path = store.save(CUSTOM)
    profile, warning = store.startup_profile(path)
    assert warning is None and profile == CUSTOM


def test_config_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CONFIG_DIR", str(tmp_path / "cfg"))
    assert ProfileStore().profiles_dir == tmp_path / "cfg" / "profiles"


def test_profiles_module_imports_without_qt_or_torch():
    code = ("import sys, engine.profiles; "
            "bad = [m for m in ('PySide6', 'torch') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_load_panels_workload_is_saved_in_the_profile_and_an_older_file_gets_the_default(store, tmp_path):
    from engine.workload import Workload
    mine = replace(CUSTOM, workload=Workload(max_concurrency=4, request_rate=2.5, num_prompts=16, shared_prefix_len=300,
                                             prompt_set="repeat", output_len=32, seed=7))
    path = store.save(mine)
    assert json.loads(path.read_text())["workload"] == {
        "max_concurrency": 4, "request_rate": 2.5, "burstiness": 1.0, "num_prompts": 16, "shared_prefix_len": 300,
        "prompt_set": "repeat", "input_len": 256, "output_len": 32, "seed": 7}
    assert store.load("mine").workload == mine.workload
    v2 = {"format": FORMAT, "version": 2, "name": "v2"}
    (tmp_path / "v2.json").write_text(json.dumps(v2))
    assert read_profile(tmp_path / "v2.json").workload == Workload()


@pytest.mark.parametrize("workload, message", [
    ({"max_concurrency": 0}, r"max_concurrency \(Concurrent users\) must be in 1..4096"),
    ({"prompt_set": "poems"}, "prompt_set must be one of"),
    ({"users": 4}, r"unknown workload fields \['users'\]"),
    ([4], "workload must be an object"),
])
def test_a_bad_workload_in_a_profile_is_refused_naming_the_field(tmp_path, workload, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"format": FORMAT, "version": VERSION, "workload": workload}))
    with pytest.raises(ProfileError, match=message):
        read_profile(path)
