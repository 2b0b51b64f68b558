"""What differs between the vLLM releases kvplug's integration runs on (0.32, 0.33, 0.34).

Everything version-specific in `kvplug.vllm` is here, found by feature, not by version
number, so the rest of the package reads one API:

- **Block hash slots.** vLLM 0.32-0.33 keep a block's hash in the slots
  ``KVCacheBlock._block_hash`` / ``_block_hash_num_tokens`` behind read-only properties;
  0.34 made the slots public fields, ``block_hash`` / ``block_hash_num_tokens``, and
  dropped the private names. kvplug's hot paths read and write the private names (a
  property costs a Python call per read), so on 0.34 `install` adds them to
  `KVCacheBlock` as aliases of the public slots' own descriptors: the same storage, read
  at C speed, and nothing of vLLM's own changes.
- **The prefix-cache map.** vLLM's `BlockHashToBlockMap._cache` maps a key to a block,
  or to ``{block_id: block}`` when several blocks hold it (0.32-0.33); in 0.34 it maps a
  key to one block id, with every id of a duplicated key in ``_dup_ids``.
  `cached_blocks` and `cached_items` read either; `copy_index` gives compiled code the
  index where a key held more than once maps to a dict keyed by block ids, in either.
- **The null block in a touch.** vLLM 0.32's `BlockPool.touch` gives the null block a
  reference (and a metrics call); 0.33 skips it. `TOUCH_COUNTS_NULL` says which, found
  by running vLLM's own `touch` once on a null block.
- **A model runner's output.** `ModelRunnerOutput` took ``req_id_to_index`` up to 0.33;
  0.34 dropped it (a request's index is its place in ``req_ids``).
  `model_runner_output` builds one for either.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

from vllm.v1.core.kv_cache_utils import KVCacheBlock

# 0.34+: the hash is a public slot; before, a private slot behind a property
PUBLIC_HASH_SLOTS = not isinstance(KVCacheBlock.__dict__.get("block_hash"), property)


def _touch_counts_null() -> bool:
    """Whether vLLM's `BlockPool.touch` gives the null block a reference: vLLM's own
    `touch` run on a null block and no pool."""
    from types import SimpleNamespace

    from vllm.v1.core.block_pool import BlockPool

    null = KVCacheBlock(0)
    null.is_null = True
    BlockPool.touch(SimpleNamespace(free_block_queue=None, metrics_collector=None), [null])
    return null.ref_cnt == 1


TOUCH_COUNTS_NULL = _touch_counts_null()


def install() -> None:
    """Give `KVCacheBlock` the private hash names kvplug reads (0.34+; idempotent)."""
    if not PUBLIC_HASH_SLOTS or "_block_hash" in KVCacheBlock.__dict__:
        return
    KVCacheBlock._block_hash = KVCacheBlock.__dict__["block_hash"]
    KVCacheBlock._block_hash_num_tokens = KVCacheBlock.__dict__["block_hash_num_tokens"]


def cached_blocks(hash_map: Any, key: Any) -> list[KVCacheBlock]:
    """Every block `hash_map` (a `BlockHashToBlockMap`) holds under `key`, in insertion
    order; empty if none."""
    dup_ids = getattr(hash_map, "_dup_ids", None)
    if dup_ids is not None:  # 0.34+: block ids
        found = hash_map._cache.get(key)
        if found is None:
            return []
        ids = dup_ids.get(key)
        blocks = hash_map._blocks
        return [blocks[found]] if ids is None else [blocks[i] for i in ids]
    found = hash_map._cache.get(key)
    if found is None:
        return []
    return list(found.values()) if isinstance(found, dict) else [found]


def copy_index(hash_map: Any) -> tuple[dict[Any, Any], bool]:
    """Where `hash_map` may hold copies, as data compiled code reads: ``(index, values)``;
    it may hold more than one block under a key only if `index` has the key and, with
    `values`, its value is a dict."""
    dup_ids = getattr(hash_map, "_dup_ids", None)
    if dup_ids is not None:  # 0.34+
        return dup_ids, False
    return hash_map._cache, True


def map_entries(hash_map: Any) -> dict[Any, Any]:
    """`hash_map`'s entries as compiled code reads them (`kvplug.core.dense.is_held`): a
    key's value is its block or a dict of its blocks by id (up to 0.33), or its block
    id (0.34+)."""
    entries: dict[Any, Any] = hash_map._cache
    return entries


def cached_items(hash_map: Any) -> Iterator[tuple[Any, list[KVCacheBlock]]]:
    """``(key, blocks)`` for every key of `hash_map`."""
    for key in list(hash_map._cache):
        yield key, cached_blocks(hash_map, key)


def model_runner_output(req_ids: list[str], sampled_token_ids: list[list[int]]) -> Any:
    """A `ModelRunnerOutput` of one step sampling `sampled_token_ids` for `req_ids`."""
    from vllm.v1.outputs import ModelRunnerOutput

    kwargs: dict[str, Any] = {"req_ids": req_ids, "sampled_token_ids": sampled_token_ids}
    if _takes_index():  # up to 0.33
        kwargs["req_id_to_index"] = {req_id: i for i, req_id in enumerate(req_ids)}
    return ModelRunnerOutput(**kwargs)


@functools.cache
def _takes_index() -> bool:
    from vllm.v1.outputs import ModelRunnerOutput

    return any(f.name == "req_id_to_index" for f in dataclasses.fields(ModelRunnerOutput))


install()

__all__ = [
    "PUBLIC_HASH_SLOTS",
    "cached_blocks",
    "cached_items",
    "copy_index",
    "install",
    "model_runner_output",
]
