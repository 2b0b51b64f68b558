"""SGLang's cache operations, issued as its scheduler issues them, on one cache built by
SGLang's unit-test fixture (`sglang_fixture.build`), and random sequences of them.

`Driver(shape, policy, core)` keeps the cache and its locks; on SGLang's Python tree core
(``core="python"``) it also logs every state an eviction walk frees. `apply` runs one
operation of `op_list` on it.
"""

from __future__ import annotations

from array import array
from typing import Any

from hypothesis import strategies as st
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang_fixture import FULL, SHAPES, build, match_prefix


def path(node: Any) -> tuple[int, ...]:
    """A node's tokens from the root: the same node in two caches."""
    parts = []
    while node.parent is not None:
        parts.append(node.key.token_ids[: len(node.key)].tolist())
        node = node.parent
    return tuple(token for part in reversed(parts) for token in part)


class Driver:
    """SGLang's cache operations on one cache, as its scheduler issues them."""

    def __init__(self, shape: str, policy: str, core: str = "python") -> None:
        self.cfg = SHAPES[shape]
        self.cache, self.allocator, self.pool = build(shape, policy, core)
        self.locks: list[Any] = []
        # Device states freed, in order: (the eviction walk's component, the freed
        # state's component, the node's path).
        self.freed: list[tuple[str, str, tuple[int, ...]]] = []
        self.tombstones = 0  # SWA / Mamba states freed from nodes that stay in the tree
        if core != "python":  # the Rust core's walk is not Python's to log
            return
        tree = self.cache.tree_core
        evict_state, start_walk = tree._evict_component_and_detach_lru, tree.evict_device_start
        walk = ["-"]

        def logged(node: Any, comp: Any, *args: Any, **kwargs: Any) -> Any:
            if node.component_data[comp.component_type].value is not None:
                self.freed.append((walk[0], comp.component_type.name, path(node)))
            return evict_state(node, comp, *args, **kwargs)

        def started(component: Any, request_cnt: int) -> None:
            walk[0] = component.name
            start_walk(component, request_cnt)

        # The tree's own calls find these first.
        tree._evict_component_and_detach_lru = logged
        tree.evict_device_start = started

    def walk_frees(self) -> list[tuple]:
        """Every eviction walk's frees, in order."""
        return list(self.freed)

    def holding(self, component: Any) -> dict[int, Any]:
        """The nodes that hold `component`'s device state, by id."""
        tree = self.cache.tree_core
        return {
            node.id: node
            for node in tree._collect_all_nodes()
            if node is not tree.root_node and node.component_data[component].value is not None
        }

    def insert(self, tokens: list[int]) -> int:
        tokens = tokens[: len(tokens) // self.cfg.page_size * self.cfg.page_size]
        if not tokens or self.allocator.available_size() < len(tokens):
            return -1
        params = InsertParams(
            key=RadixKey(array("q", tokens)), value=self.allocator.alloc(len(tokens))
        )
        if self.cfg.has_mamba:
            req = self._request()
            if req is None:
                return -1
            params.mamba_value = req.kv.mamba_pool_idx.unsqueeze(0)
        return self.cache.insert(params).prefix_len

    def match_and_lock(self, tokens: list[int]) -> int:
        match = match_prefix(self.cache, tokens)
        self.locks.append(self.cache.lock(match.last_device_node))
        return match.device_prefix_len

    def unlock(self, pick: int) -> None:
        if self.locks:
            self.cache.unlock(self.locks.pop(pick % len(self.locks)))

    def evict(self, amount: int, full: bool = True) -> tuple[int, int, int]:
        """SGLang's eviction for `amount` pages of full attention (if `full`), `amount`
        sliding-window tokens and one Mamba state (`amount` without `full`)."""
        params = EvictParams(num_tokens=amount * self.cfg.page_size if full else 0)
        if self.cfg.has_swa:
            params.swa_num_tokens = amount
        if self.cfg.has_mamba:
            params.mamba_num = 1 if full else amount
        aux = [ct for ct in self.cache.tree_components if ct is not FULL]
        before = {ct: set(self.holding(ct)) for ct in aux}
        result = self.cache.evict(params)
        if not aux:
            return (result.num_tokens_evicted, 0, 0)
        present = {node.id: node for node in self.cache.tree_core._collect_all_nodes()}
        for ct in aux:
            self.tombstones += sum(
                1
                for node_id in before[ct]
                if node_id in present and present[node_id].component_data[ct].value is None
            )
        return (
            result.num_tokens_evicted,
            getattr(result, "swa_num_tokens_evicted", 0),
            getattr(result, "mamba_num_evicted", 0),
        )

    def sizes(self) -> tuple[int, ...]:
        tree = self.cache.tree_core
        return tuple(
            size
            for component in self.cache.tree_components
            for size in (
                tree.component_evictable_size(component),
                tree.component_protected_size(component),
            )
        )

    def _request(self) -> Any:
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = Req(
            rid="x", origin_input_text="", origin_input_ids=array("q"),
            sampling_params=SamplingParams(temperature=0, max_new_tokens=1),
        )  # fmt: skip
        if self.pool.alloc([req]) is None:
            return None
        return req


prefixes = st.lists(st.integers(1, 6), min_size=1, max_size=12)
op_list = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.integers(0, 2), st.integers(1, 12), st.integers(0, 9)),
        st.tuples(st.just("match"), st.integers(0, 2), st.integers(1, 12)),
        st.tuples(st.just("unlock"), st.integers(0, 7)),
        st.tuples(st.just("evict"), st.integers(1, 8)),
        st.tuples(st.just("evict_state"), st.integers(1, 8)),
    ),
    max_size=24,
)


def apply(driver: Driver, bases: list[list[int]], op: tuple) -> Any:
    if op[0] == "insert":
        _, which, cut, tail = op
        suffix = [100 + tail] * 4 if tail < 7 else []  # none: a later insert may extend it
        return driver.insert(bases[which % len(bases)][:cut] + suffix)
    if op[0] == "match":
        _, which, cut = op
        return driver.match_and_lock(bases[which % len(bases)][:cut])
    if op[0] == "unlock":
        return driver.unlock(op[1])
    return driver.evict(op[1], full=op[0] == "evict")


def check(driver: Driver) -> None:
    driver.cache.tree_core.check_invariants()
    driver.cache.sanity_check()
