"""Can kvplug choose SGLang's victims on its Rust tree core? A probe of what the core exposes.

kvplug's SGLang adapter runs SGLang's Python tree core, because the default Rust core
(`RustUnifiedTreeCore`) accepts only SGLang's own policy names. Deciding on the Rust core
needs two things from it: the tree's shape, to rank its leaves, and a way to evict a leaf
kvplug chose. This probe drives SGLang's `UnifiedRadixCache` on the Rust core (the replay's
SGLang arm, with ``tree_core_backend="rust"``) through two requests that share a prefix,
then prints:

- `collect_path_info` for a matched node: one tuple per node on its path (node id, parent
  id, start, end, length, children), enough to mirror the tree;
- the tree after `evict_device_leaf` on a leaf the probe chose (not the core's own walk),
  the KV events it emitted and the slots it handed back (freed here, as SGLang's cache
  controller frees them).

    .venv-sglang/bin/python studies/sglang_rust_core_probe.py
"""

from __future__ import annotations

from array import array

from kvplug.replay.arms.sglang import SGLangStockArm


class RustCoreArm(SGLangStockArm):
    """SGLang's stock arm on the Rust tree core (SGLang's default in a server)."""

    def _build_cache(self, params: object, policy: str) -> object:
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        params.tree_core_backend = "rust"  # type: ignore[attr-defined]
        return UnifiedRadixCache(params)


def main() -> None:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    arm = RustCoreArm(64, "lru")
    core = arm.cache.tree_core
    print("tree core:", type(core).__name__)
    for number, prompt in enumerate(([1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8, 9])):
        arm.admit(number, [*prompt, 1000 + number], len(prompt))
        arm.finish(number, 0)
    with arm._sglang():
        match = arm.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", [1, 2, 3, 4]))))
        first = arm.cache.match_prefix(
            MatchPrefixParams(key=RadixKey(array("q", [1, 2, 3, 4, 5, 6, 1000])))
        )
        print("path of the first request's node:", core.collect_path_info([first.last_device_node]))
        print("a lookup of [1, 2, 3, 4] ends at node", match.last_device_node)
        print(core._binding.pretty_print())
        leaf = first.last_device_node
        core.take_events()
        core.evict_device_start(ComponentType.FULL, 3)
        evicted = core.evict_device_leaf(leaf, core.is_write_back)
        core.evict_device_end(ComponentType.FULL)
        freed = 0
        for component in list(evicted.device_frees):  # drained as the controller drains
            for slots in evicted.device_frees.pop(component):
                freed += len(slots)
                arm.allocator.free(slots)
        print("cache actions:", evicted.cache_actions, "tracker:", dict(evicted.tracker))
        evicted.cache_actions.clear()
        print(f"after evicting node {leaf} (chosen here): {freed} slots handed back")
        print(core._binding.pretty_print())
        print("events:", core.take_events())
        print("evictable tokens:", core.evictable_size())


if __name__ == "__main__":
    main()
