"""What the window says, from plain dicts: a server's missing numbers stay missing."""
from app.formatting import describe_settings, message_stats

SUMMARY = {"ttft_s": 0.1, "decode_tok_s": 10.0, "generated_tokens": 5, "acceptance_rate": 0.5, "accepted": 2,
           "proposed": 4, "mean_accepted_len": None, "prefix_hit_tokens": 0, "prompt_tokens": 3}


def test_a_reply_stats_line_without_tau_leaves_it_out():
    line = message_stats(SUMMARY, "stop")
    assert "acceptance 50% (2/4)" in line and "τ" not in line
    assert "τ=2.00" in message_stats(SUMMARY | {"mean_accepted_len": 2.0}, "stop")
    auto = message_stats(SUMMARY | {"drafted_by": {"eagle": 3, "suffix": 9}}, "stop")
    assert "acceptance 50% (2/4) · drafted by suffix ×9, eagle ×3" in auto     # proposer auto's choices


def test_the_cache_line_says_why_the_engine_chose_its_dtype():
    html = describe_settings({"kv_cache_dtype": "fp8_e4m3", "block_size": 16, "kv_pool_blocks": 9,
                     "kv_cache_why": "FP8 since 1 request preempted for want of blocks at step 7"})
    assert "fp8_e4m3, block 16, 9 blocks <i>(FP8 since 1 request preempted for want of blocks at step 7)</i>" in html


def test_a_kv_dtype_a_server_does_not_report_is_said_to_be_missing():
    assert message_stats(SUMMARY, "stop", {"kv_cache_dtype": "fp8_e4m3"}).endswith("KV fp8_e4m3")
    assert message_stats(SUMMARY, "stop", {"kv_cache_dtype": None}).endswith("KV dtype not reported")


def test_a_server_shows_its_launch_fixed_settings_with_their_flags():
    html = describe_settings({"backend": "remote", "server": "llama.cpp", "server_version": None, "url": "http://h:1",
                              "model": "m", "metrics": "available", "kv_cache_dtype": None,
                              "read_only": {"kv_cache_dtype": "--cache-type-k"}})
    assert "llama.cpp at http://h:1, model m" in html
    assert "kv_cache_dtype</b>: not reported <i>(fixed at launch: --cache-type-k)" in html


def test_in_effect_names_the_cpu_kernels_that_passed_their_trial():
    """On an AVX2-only CPU oneDNN refuses bf16: the panel says which kernel runs instead, and why."""
    refused = "torch matmul (oneDNN refused bfloat16 here: bf16 path needs the cpu support avx512bw)"
    html = describe_settings({"device": "cpu", "dtype": "bfloat16", "threads": 2,
                              "paths": {"isa": "avx2", "linear": refused, "quantized": "ours (avx2), int8 activations per 32",
                                        "dtype": "bfloat16 (auto: the faster here)"}})
    assert f"<b>CPU kernels</b> (avx2): linears {refused}; quantized weights ours (avx2), int8 activations per 32; dtype bfloat16" in html
    assert "CPU kernels" not in describe_settings({"device": "cuda", "paths": {"isa": "cuda", "dtype": "bf16"}})


def test_in_effect_says_when_other_programs_took_cores():
    busy = describe_settings({"device": "cpu", "dtype": "float32", "threads": 1,
                              "thread_policy": "1 of 2: other programs keep 1 of 2 cores busy"})
    assert "1 torch thread (1 of 2: other programs keep 1 of 2 cores busy)" in busy
    quiet = describe_settings({"device": "cpu", "dtype": "float32", "threads": 2, "thread_policy": "2 (OpenMP's default wait)"})
    assert quiet.endswith("2 torch threads")


def test_auto_says_which_proposer_drafts_and_why():
    html = describe_settings({"proposer": "auto", "num_speculative_tokens": 8,
                              "proposer_choice": {"chosen": "suffix", "why": "suffix has the highest expected rate"}})
    assert "auto, k=8; now suffix: suffix has the highest expected rate" in html


def test_a_hybrid_models_state_and_its_prefix_snapshots_are_said():
    """In effect's memory plan line gives the state slots and the prefix snapshots apart from KV,
    and a reply whose hit was cut back to a state snapshot says how many cached tokens it recomputed."""
    from app.formatting import describe_memory_plan
    plan = {"weights_bytes": 2**20, "draft_weights_bytes": 0, "kv_pool_bytes": 2**22, "tokens_that_fit": 4096,
            "reserve_bytes": 2**20, "reserve_tokens": 512, "device": "cpu", "budget": "kv_cache_bytes",
            "state": {"state_slots": 33, "state_bytes_per_sequence": 16896, "state_pool_bytes": 33 * 16896,
                      "prefix_snapshots": 115, "prefix_snapshot_bytes": 115 * 16896}}
    assert describe_memory_plan(plan).endswith(
        "; linear-layer state 33 slots × 16.5 KiB = 544 KiB, prefix snapshots up to 115 (1.85 MiB)")
    line = message_stats(SUMMARY | {"prefix_hit_tokens": 896, "prompt_tokens": 951, "prefix_recomputed_tokens": 32}, "stop")
    assert "prefix hit 896/951 tokens · 32 cached tokens recomputed (no state saved there)" in line
