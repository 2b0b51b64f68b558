"""Arm names are parsed once, into `ArmSpec`; a bad one is refused naming what is accepted."""

from __future__ import annotations

import pytest

from kvplug.errors import UnknownPolicyError
from kvplug.replay.arm_spec import ArmSpec, Cache, parse_arm


@pytest.mark.parametrize(
    ("name", "spec"),
    [
        ("cost", ArmSpec("cost", Cache.KVPLUG, "cost")),
        ("belady", ArmSpec("belady", Cache.KVPLUG, "belady")),
        ("vllm-stock", ArmSpec("vllm-stock", Cache.VLLM_STOCK, None)),
        ("vllm-kvplug:lfu", ArmSpec("vllm-kvplug:lfu", Cache.VLLM_KVPLUG, "lfu")),
        ("sglang-stock", ArmSpec("sglang-stock", Cache.SGLANG_STOCK, "lru")),
        ("sglang-stock:slru", ArmSpec("sglang-stock:slru", Cache.SGLANG_STOCK, "slru")),
        ("sglang-kvplug:cost", ArmSpec("sglang-kvplug:cost", Cache.SGLANG_KVPLUG, "cost")),
    ],
)
def test_arm_names_parse_into_one_spec(name: str, spec: ArmSpec) -> None:
    assert parse_arm(name) == spec
    assert spec.engine == (None if spec.cache is Cache.KVPLUG else name.split("-")[0])
    assert (spec.kvplug_policy is None) == (spec.cache in (Cache.VLLM_STOCK, Cache.SGLANG_STOCK))


@pytest.mark.parametrize(
    "name", ["arc", "vllm-stock:lru", "vllm-kvplug:belady", "vllm-kvplug", "sglang-kvplug:", "x:y"]
)
def test_unknown_arms_are_refused_naming_what_is_accepted(name: str) -> None:
    with pytest.raises(UnknownPolicyError, match=rf"unknown arm '{name}'; accepted: .*vllm-stock"):
        parse_arm(name)


def test_a_restricted_set_of_kvplug_policies() -> None:
    assert parse_arm("vllm-kvplug:cost", ("lru", "cost")).policy == "cost"
    with pytest.raises(UnknownPolicyError, match="unknown hybrid arm 'lfu'; accepted: lru, cost"):
        parse_arm("lfu", ("lru", "cost"), "hybrid arm")
