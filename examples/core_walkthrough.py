"""A walk through kvplug's engine-neutral cache: sharing, copy-on-write, fences, eviction.

Run: python examples/core_walkthrough.py
"""

from pathlib import Path

from kvplug.config import KVPlugConfig
from kvplug.core.cache import KVCache
from kvplug.core.keys import Namespace

config = KVPlugConfig.load(Path(__file__).with_name("kvplug.yaml"))
cache = KVCache.from_config(config, num_blocks=12, block_size=4, namespace=Namespace(model="demo"))

system = [101, 102, 103, 104, 105, 106, 107, 108]  # a shared system prompt, two blocks

# Request a: nothing cached yet. Its prompt is written in step 1; blocks become visible
# to other requests only once that step is fenced.
cached = cache.add_request("a", system + [1, 2])
cache.append("a", (system + [1, 2])[cached:])
print("a: cached tokens", cached, "table", cache.block_table("a"))
cache.complete_step()

# Request b shares the system prompt: its first two blocks are a's blocks.
cached = cache.add_request("b", system + [3, 4, 5])
cache.append("b", (system + [3, 4, 5])[cached:])
print("b: cached tokens", cached, "table", cache.block_table("b"))

# Parallel sampling: fork b; the first write into the shared partial tail copies it.
cache.fork("b", "b/2")
print("b/2 appends one token; copies:", cache.append("b/2", [9]).copies)
cache.complete_step()

# Cancel a request while its step is in flight: its blocks wait for the fence.
cache.add_request("c", [7] * 9)
cache.append("c", [7] * 9)
cache.cancel("c")
print("after cancelling c mid-step:", cache.usage().blocks_by_state)
cache.complete_step()
print("after the fence:            ", cache.usage().blocks_by_state)

for req in ("a", "b", "b/2"):
    cache.finish(req)
cache.check_invariants()
print("metrics:", cache.metrics.as_dict())
