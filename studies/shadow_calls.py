"""What `learned`'s shadow caches cost per sampled key, compiled and as plain Python.

The dense core calls `ShadowDuel.access` for each sampled block cached or hit and
`ShadowDuel.release` for each sampled block released (at 10k blocks in vLLM's step,
about 40 and 30 calls a step in a long run). This times both calls on the build's module
and on the same source run as plain Python (whose shadows are `LazyShadowCache`), side
by side, over the same keys, and the policy's own
`shadow_access` (the generic core's path: the block's value looked up, then the duel).

    python studies/shadow_calls.py [--blocks 10000] [--keys 4000]
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import timeit
from pathlib import Path
from types import ModuleType

import kvplug.policies.shadow
from kvplug.policies.learned import LearnedPolicy


def plain_shadow_module() -> ModuleType:
    source = Path(kvplug.policies.shadow.__file__ or "").with_name("shadow.py")
    spec = importlib.util.spec_from_file_location("shadow_plain", source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=10_000, help="the real cache's blocks")
    parser.add_argument("--keys", type=int, default=4_000, help="sampled keys per pass")
    args = parser.parse_args()
    policy = LearnedPolicy(tokens_per_block=16)
    policy.bind(16, args.blocks)
    capacity, window = policy.duel.learned.capacity, policy.duel.window
    keys = [random.Random(i).randbytes(32) for i in range(args.keys)]
    value = policy.value.at_depth(5)
    print(f"shadow capacity {capacity:,} per shadow, referee window {window:,} accesses")
    print(f"{'module':<8} {'access us':>10} {'release us':>11} {'policy access us':>17}")
    modules = [("build", kvplug.policies.shadow), ("plain", plain_shadow_module())]
    for label, module in modules:
        duel = module.ShadowDuel(capacity, window, 0.0)
        policy.duel = duel  # the policy's path through this module's duel

        def accesses(duel=duel) -> None:
            for key in keys:
                duel.access(key, value)

        def releases(duel=duel) -> None:
            for key in keys:
                duel.release(key, 1.5)

        def policy_accesses() -> None:
            for key in keys:
                policy.shadow_access(key, 5)

        times = [
            min(timeit.repeat(call, number=5, repeat=7)) / 5 / len(keys) * 1e6
            for call in (accesses, releases, policy_accesses)
        ]
        compiled = " (compiled)" if module.COMPILED else ""
        print(f"{label:<8} {times[0]:>10.3f} {times[1]:>11.3f} {times[2]:>17.3f}{compiled}")


if __name__ == "__main__":
    main()
