"""Property-based tests: random operation sequences against the cache's invariants (the
state machine is `cache_machine.CacheMachine`, shared with the policies' suite)."""

from __future__ import annotations

from cache_machine import MACHINE_EXAMPLES, CacheMachine, prompts
from hypothesis import given, settings

from kvplug.core.cache import KVCache

TestCacheProperties = CacheMachine.TestCase
TestCacheProperties.settings = settings(TestCacheProperties.settings, max_examples=MACHINE_EXAMPLES)


@given(prompts)
def test_a_fully_cached_prompt_still_computes_its_last_token(prompt: list[int]) -> None:
    cache = KVCache(64, 2)
    cache.add_request("a", prompt)
    cache.append("a", prompt)
    cache.complete_step()
    cache.finish("a")
    cached = cache.add_request("b", prompt)
    assert cached == ((len(prompt) - 1) // 2) * 2
    assert cached < len(prompt)
