"""The memory plan: the KV pool is sized per device (CUDA: what this process may hold, the
gpu_memory_fraction of the device less what other processes hold, after its own tensors and
the activation reserve; CPU: a budget that scales with RAM),
a draft's weights and cache count in the same plan, and the plan is what gets allocated."""
import gc

import pytest
import torch

from engine.config import EngineConfig, SamplingParams
from engine.errors import CacheTooSmallError
from engine.cache.memory_plan import (CPU_BUDGET_MAX, CPU_BUDGET_MIN, CUDA_FIXED_RESERVE, GiB, MiB, activation_bytes,
                                plan_memory, weights_bytes)

CPU, CUDA = torch.device("cpu"), torch.device("cuda")     # plans only: nothing is allocated on CUDA


def _per_block(model, config=EngineConfig()) -> int:
    shape = model.cache_shape                               # the tiny model is fp32: fp32 KV by default
    return shape.bytes_per_token(torch.float32) * config.block_size


@pytest.mark.parametrize("ram, budget", [(64 * GiB, 2 * GiB), (2 * GiB, CPU_BUDGET_MIN), (1024 * GiB, CPU_BUDGET_MAX)])
def test_the_cpu_pool_scales_with_ram(tiny_model, ram, budget):
    plan = plan_memory(EngineConfig(), CPU, tiny_model.model, memory=(ram, ram))
    per_block = _per_block(tiny_model.model)
    assert plan.num_blocks == budget // per_block and plan.budget == "RAM/32"
    assert plan.kv_pool_bytes == plan.num_blocks * per_block <= budget
    assert plan.tokens_that_fit == plan.num_blocks * 16
    assert plan.weights_bytes == sum(p.numel() * 4 for p in tiny_model.model.parameters())


def test_on_cuda_the_pool_gets_what_the_fraction_leaves_after_memory_in_use_and_the_reserve(tiny_model):
    total, free = 80 * GiB, 60 * GiB                        # 20 GiB in use: our weights, the context, others
    torch_attention = plan_memory(EngineConfig(attention_backend="torch"), CUDA, tiny_model.model,
                                  memory=(free, total))
    assert torch_attention.reserve_bytes == activation_bytes(tiny_model.model, 2048, kernels=False) + CUDA_FIXED_RESERVE
    plan = plan_memory(EngineConfig(), CUDA, tiny_model.model, memory=(free, total))
    budget = int(0.9 * total) - (total - free) - plan.reserve_bytes
    assert plan.num_blocks == budget // _per_block(tiny_model.model)
    assert plan.budget == "gpu_memory_fraction 0.9" and plan.total_bytes == total
    smaller = plan_memory(EngineConfig(gpu_memory_fraction=0.5), CUDA, tiny_model.model, memory=(free, total))
    assert smaller.kv_pool_bytes < plan.kv_pool_bytes - 30 * GiB


def test_a_gpu_without_room_for_one_block_says_what_to_change(tiny_model):
    with pytest.raises(CacheTooSmallError, match="no room for a KV cache on cuda.*raise gpu_memory_fraction"):
        plan_memory(EngineConfig(gpu_memory_fraction=0.5), CUDA, tiny_model.model, memory=(40 * GiB, 80 * GiB))


@pytest.fixture
def shared_gpu(monkeypatch):
    """torch.cuda's memory queries as a shared 80 GiB GPU answers them (fakes: no GPU needed):
    30 GiB free; this process's allocator holds 12 GiB, of which its tensors use 2 GiB (the
    other 10 GiB cached, freed by a bench before). Records what the plan calls, in order."""
    calls, answers = [], {"free": 30 * GiB, "total": 80 * GiB, "reserved": 12 * GiB, "allocated": 2 * GiB}

    def call(name, value=None):
        def fake(*args, **kwargs):
            calls.append(name)
            return value() if value else None
        return fake
    monkeypatch.setattr(gc, "collect", call("collect", lambda: 0))
    monkeypatch.setattr(torch.cuda, "empty_cache", call("empty_cache"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", call("mem_get_info", lambda: (answers["free"], answers["total"])))
    monkeypatch.setattr(torch.cuda, "memory_reserved", call("memory_reserved", lambda: answers["reserved"]))
    monkeypatch.setattr(torch.cuda, "memory_allocated", call("memory_allocated", lambda: answers["allocated"]))
    return calls, answers


def test_on_cuda_this_process_may_hold_its_fraction_less_what_other_processes_hold(tiny_model, shared_gpu):
    """Others hold 80 - 30 - 12 = 38 GiB, so this process may hold 0.9 * 80 - 38 = 34 GiB; its
    tensors use 2 GiB of that: the pools get 32 GiB less the reserve. The 10 GiB torch has cached
    count for nobody; unreachable tensors are collected and the cache released before measuring."""
    calls, _ = shared_gpu
    plan = plan_memory(EngineConfig(), CUDA, tiny_model.model)
    assert calls[:3] == ["collect", "empty_cache", "mem_get_info"]
    assert plan.others_bytes == plan.as_dict()["others_bytes"] == 38 * GiB
    budget = int(0.9 * 80 * GiB) - 38 * GiB - 2 * GiB - plan.reserve_bytes
    assert plan.num_blocks == budget // _per_block(tiny_model.model) and plan.budget == "gpu_memory_fraction 0.9"
    whole_device = int(0.9 * 80 * GiB) - (80 - 30) * GiB - plan.reserve_bytes      # the old rule: 20 GiB
    assert plan.kv_pool_bytes > whole_device + 9 * GiB


def test_a_gpu_that_others_fill_says_how_much_they_hold(tiny_model, shared_gpu):
    _, answers = shared_gpu
    answers.update(free=4 * GiB, reserved=2 * GiB)          # others: 74 GiB of 80
    with pytest.raises(CacheTooSmallError, match=r"80.00 GiB in all, other processes and CUDA contexts 74.00 GiB"):
        plan_memory(EngineConfig(), CUDA, tiny_model.model)


def test_kv_cache_bytes_and_num_blocks_override_the_plan(tiny_model):
    memory = (60 * GiB, 80 * GiB)
    by_bytes = plan_memory(EngineConfig(kv_cache_bytes=8 * MiB), CUDA, tiny_model.model, memory=memory)
    assert by_bytes.num_blocks == 8 * MiB // _per_block(tiny_model.model) and by_bytes.budget == "kv_cache_bytes"
    by_blocks = plan_memory(EngineConfig(kv_cache_bytes=8 * MiB, num_blocks=7), CPU, tiny_model.model, memory=memory)
    assert by_blocks.num_blocks == 7 and by_blocks.budget == "num_blocks"


def test_a_draft_shares_the_budget_and_its_own_weights_count(tiny_model, tmp_path):
    from engine.loading.loader import early_exit_draft, load_model
    from engine.loading.synthetic import write_checkpoint
    config = EngineConfig(kv_cache_bytes=8 * MiB)
    alone = plan_memory(config, CPU, tiny_model.model)
    other = load_model(str(write_checkpoint(tmp_path, "tiny", seed=5)))
    with_draft = plan_memory(config, CPU, tiny_model.model, other.model)
    both_per_block = 2 * _per_block(tiny_model.model)
    assert with_draft.num_blocks == 8 * MiB // both_per_block < alone.num_blocks
    assert with_draft.kv_pool_bytes <= 8 * MiB
    assert with_draft.draft_weights_bytes == weights_bytes(other.model) > 0
    assert with_draft.weights_bytes == alone.weights_bytes + with_draft.draft_weights_bytes
    shared = plan_memory(config, CPU, tiny_model.model, early_exit_draft(tiny_model, 1).model)
    assert shared.draft_weights_bytes == 0 and shared.weights_bytes == alone.weights_bytes


def test_the_engine_allocates_what_its_plan_says_with_and_without_a_draft(make_tiny_engine):
    eng = make_tiny_engine()
    plan = eng.settings()["memory_plan"]
    assert plan["kv_pool_bytes"] == eng.kv_bytes()[1] and plan["tokens_that_fit"] == eng.runner.kv.num_blocks * 16
    eng.set_draft_model("self:1")
    with_draft = eng.settings()["memory_plan"]
    assert with_draft["kv_pool_bytes"] == eng.kv_bytes()[1] <= 8 * MiB        # the two pools share the budget
    assert eng.draft_runner.kv.num_blocks == eng.runner.kv.num_blocks == with_draft["tokens_that_fit"] // 16
    assert with_draft["tokens_that_fit"] < plan["tokens_that_fit"]
    eng.reconfigure(kv_cache_dtype="fp8_e4m3")                    # 1 byte + scales instead of 4: more tokens fit
    assert eng.settings()["memory_plan"]["tokens_that_fit"] > 3 * with_draft["tokens_that_fit"]
    assert eng.settings()["memory_plan"]["kv_pool_bytes"] == eng.kv_bytes()[1]


def test_a_pool_too_small_for_one_block_is_refused_and_the_old_pool_kept(make_tiny_engine):
    eng = make_tiny_engine()
    before = eng.settings()
    with pytest.raises(CacheTooSmallError, match="no room for a KV cache"):
        eng.reconfigure(kv_cache_bytes=100)
    assert eng.settings() == before and eng.config.kv_cache_bytes == 8 * MiB
    assert eng.generate_text("Hello", SamplingParams(max_tokens=4))[1]


def test_the_app_shows_the_plan_in_one_line(make_tiny_engine):
    from app.formatting import describe_settings
    eng = make_tiny_engine()
    eng.set_draft_model("self:1")
    plan = eng.settings()["memory_plan"]
    line = [s for s in describe_settings(eng.settings()).split("<br>") if "Memory plan" in s]
    assert line == [f"<b>Memory plan</b>: weights {plan['weights_bytes'] / MiB:.0f} MiB, KV pool "
                    f"{plan['kv_pool_bytes'] / MiB:.0f} MiB = {plan['tokens_that_fit']:,} tokens, reserve "
                    f"{plan['reserve_bytes'] / MiB:.0f} MiB for a 2,048-token prompt (cpu, kv_cache_bytes)"]
