"""The sleep/wake plan (miles/offload/plan.py): pure decisions from measured numbers."""

from types import SimpleNamespace

import pytest

from miles.offload.plan import (DISCARD, FROM_ENGINE, FROM_MASTERS, GRADS, KEEP, OPTIMIZER_STATE, OTHER, TO_DISK,
                                TO_RAM, WEIGHTS, DEVICE_RESERVE_BYTES, EngineNeeds, Group, MemoryFacts,
                                allocator_cache_may_stay, host_ram_budget, plan_sleep)

GB = 1 << 30


def _groups(weights=18 * GB, grads=36 * GB, optim=0, engine_copy=True, from_masters=True):
    groups = [Group("weights", WEIGHTS, weights, engine_copy=engine_copy, from_masters=from_masters),
              Group("buffers", OTHER, 1 << 20), Group("grads", GRADS, grads)]
    if optim:
        groups.append(Group("optimizer", OPTIMIZER_STATE, optim))
    return groups


def _facts(**kw):
    base = dict(device_total=141 * GB, device_free=60 * GB, engine_kv=40 * GB, engine_weights=18 * GB,
                host_ram_budget=100 * GB, masters_in_host_ram=True, engine_copy_unreadable_because=None,
                reserve=GB)
    base.update(kw)
    return MemoryFacts(**base)


def _engine_fits(plan, facts):
    """After the plan's sleep, the engine's KV pool and the reserve fit the device."""
    freed = sum(d.nbytes for d in plan.decisions if d.way != KEEP)
    return facts.device_free + freed >= facts.engine_kv + facts.reserve


def test_weights_stay_when_they_fit_beside_the_engine():
    facts = _facts()
    plan = plan_sleep(_groups(), facts, "disk")
    assert plan.way_of("weights") == KEEP and plan.way_of("grads") == DISCARD
    assert plan.sleep_moved_bytes == 0 and plan.wake_moved_bytes == 0
    assert _engine_fits(plan, facts)


def test_tight_budget_moves_bytes_rather_than_fail():
    facts = _facts(device_free=2 * GB, engine_kv=50 * GB)  # grads alone do not make room
    plan = plan_sleep(_groups(grads=36 * GB), facts, "disk")
    assert plan.way_of("weights") == FROM_ENGINE  # the cheapest exact source that frees the device
    assert plan.shortfall_bytes == 0 and _engine_fits(plan, facts)
    assert plan.wake_moved_bytes == 18 * GB and plan.sleep_moved_bytes == 0


@pytest.mark.parametrize("unreadable, masters_in_ram, expected", [
    (None, True, FROM_ENGINE),
    ("sglang: the engine runs in its own process", True, FROM_MASTERS),
    ("sglang: the engine runs in its own process", False, TO_RAM),
])
def test_cheapest_exact_source_first(unreadable, masters_in_ram, expected):
    facts = _facts(device_free=0, engine_kv=100 * GB, engine_copy_unreadable_because=unreadable,
                   masters_in_host_ram=masters_in_ram)
    plan = plan_sleep(_groups(grads=0), facts, "disk")
    assert plan.way_of("weights") == expected
    if unreadable:
        assert any(unreadable in n for n in plan.notes)  # the plan says why it did not use the engine's copy


def test_engine_copy_unused_when_the_wake_would_not_fit_beside_the_engine_weights():
    facts = _facts(device_total=40 * GB, device_free=0, engine_kv=20 * GB, engine_weights=18 * GB)
    plan = plan_sleep(_groups(weights=18 * GB, grads=4 * GB), facts, "disk")
    assert plan.way_of("weights") == FROM_MASTERS
    assert any("do not fit the device together at wake" in n for n in plan.notes)


def test_ram_first_then_disk_for_what_has_no_other_source():
    groups = [Group("weights", WEIGHTS, 10 * GB), Group("opt_a", OPTIMIZER_STATE, 8 * GB),
              Group("opt_b", OPTIMIZER_STATE, 6 * GB)]
    facts = _facts(device_free=0, engine_kv=40 * GB, host_ram_budget=12 * GB, masters_in_host_ram=False,
                   engine_copy_unreadable_because="no engine")
    plan = plan_sleep(groups, facts, "disk")
    ways = {d.group: d.way for d in plan.decisions}
    assert ways == {"weights": TO_RAM, "opt_a": TO_DISK, "opt_b": TO_DISK}  # largest first; RAM up to its budget
    assert plan.shortfall_bytes > 0  # 24 GB released of 41 GB needed: said, not hidden
    assert plan.sleep_moved_bytes == 24 * GB == plan.wake_moved_bytes


def test_target_cpu_writes_to_ram_even_past_the_budget():
    facts = _facts(device_free=0, engine_kv=40 * GB, host_ram_budget=0, masters_in_host_ram=False)
    plan = plan_sleep([Group("optimizer", OPTIMIZER_STATE, 8 * GB)], facts, "cpu")
    assert plan.way_of("optimizer") == TO_RAM


def test_the_sleep_mode_is_decided_once_from_the_config():
    from miles.backends.sleep_mode import AUTO, OFF, OFFLOAD_ALL, sleep_mode
    from miles.config.arguments import OffloadConfig

    def mode(**offload):
        return sleep_mode(SimpleNamespace(offload=OffloadConfig(**offload)))

    assert mode(offload_train=False, offload_train_plan="offload-all") == OFF
    assert mode(offload_train=True) == AUTO
    assert mode(offload_train=True, offload_train_plan="offload-all") == OFFLOAD_ALL


def test_cpu_device_keeps_rather_than_copy_host_memory_to_host_memory():
    facts = _facts(device_is_host=True, device_free=0, engine_kv=4 * GB, masters_in_host_ram=False,
                   engine_copy_unreadable_because="another process")
    plan = plan_sleep(_groups(grads=0), facts, "cpu")
    assert plan.way_of("weights") == KEEP  # to_ram would free nothing
    plan = plan_sleep(_groups(grads=0), facts, "disk")
    assert plan.way_of("weights") == TO_DISK


def test_bad_target_names_the_flag():
    with pytest.raises(ValueError, match="--offload-train-target"):
        plan_sleep(_groups(), _facts(), "tape")


def test_host_ram_budget_follows_the_auto_tier_accounting():
    assert host_ram_budget(None, 0, 1, 0) == 0
    assert host_ram_budget(100 * GB, 16 * GB, 2, 10 * GB) == 32 * GB
    assert host_ram_budget(10 * GB, 16 * GB, 1, 0) == 0


def test_measured_facts_under_sglang_and_the_embedded_engine():
    """What a rank measures: sglang's copy is never readable and its unmeasured KV pool is the whole device;
    the embedded engine's copy is readable only when the driver promised it for the next wake."""
    import torch

    from miles.backends.planned_sleep import memory_facts
    from miles.offload.plan import EngineNeeds

    sglang = memory_facts(torch.device("cpu"), EngineNeeds(), None, 1, "sglang")
    assert "sglang" in sglang.engine_copy_unreadable_because and sglang.engine_kv == sglang.device_total
    assert sglang.device_is_host and not sglang.masters_in_host_ram
    plan = plan_sleep(_groups(grads=0), sglang, "disk")
    assert plan.way_of("weights") == TO_DISK and any("sglang" in n for n in plan.notes)
    assert any("KV pool is not measured" in n for n in plan.notes)  # why everything moved, in the record
    promised = memory_facts(torch.device("cpu"), EngineNeeds(kv_bytes=5, weight_bytes=7, copy_at_wake=True),
                            None, 1, "embedded")
    assert promised.engine_copy_unreadable_because is None and promised.engine_kv == 5
    assert promised.engine_weights == 7
    assert not any("KV pool" in n for n in plan_sleep(_groups(grads=0), promised, "disk").notes)
    unpromised = memory_facts(torch.device("cpu"), EngineNeeds(kv_bytes=5), None, 1, "embedded")
    assert "only on GPU" in unpromised.engine_copy_unreadable_because


def test_the_allocator_cache_stays_only_when_the_measured_engine_fits_beside_it():
    engine = EngineNeeds(kv_bytes=10 * GB, weight_bytes=2 * GB)
    after_handoff = 10 * GB + DEVICE_RESERVE_BYTES  # the KV pool + reserve, the weights already resident
    assert allocator_cache_may_stay(after_handoff, engine, engine_weights_resident=True)
    assert not allocator_cache_may_stay(after_handoff - 1, engine, engine_weights_resident=True)
    # before the handoff the engine's weights are still to come back
    assert not allocator_cache_may_stay(after_handoff, engine, engine_weights_resident=False)
    assert allocator_cache_may_stay(after_handoff + 2 * GB, engine, engine_weights_resident=False)
    # an engine that has not said what it allocates may take the whole device
    assert not allocator_cache_may_stay(1 << 60, EngineNeeds(), engine_weights_resident=True)
