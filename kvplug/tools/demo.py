"""``kvplug demo``: a small, seeded chat workload through the core cache.

Shared system prompts, multi-turn conversations that resend their history, and some
requests sampled twice (a fork with copy-on-write). Steps are fenced one behind, as an
engine with asynchronous scheduling would, so releases are really deferred. Each cache
capacity prints one row: what was reused, what was evicted, and what the tables held.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvplug.core.cache import KVCache


@dataclass
class Turn:
    conversation: int
    prompt: list[int]
    output: list[int]
    samples: int


def chat_workload(
    conversations: int = 60, turns: int = 4, system_prompts: int = 3, seed: int = 0
) -> list[Turn]:
    """Interleaved multi-turn chats; each turn's prompt is the whole history so far."""
    rng = random.Random(seed)
    systems = [
        rng.choices(range(1000, 30000), k=rng.randint(200, 400)) for _ in range(system_prompts)
    ]
    history = {c: list(rng.choice(systems)) for c in range(conversations)}
    order = [c for c in range(conversations) for _ in range(turns)]
    rng.shuffle(order)
    workload = []
    for c in order:
        history[c] += rng.choices(range(1000, 30000), k=rng.randint(20, 80))  # the user's message
        output = rng.choices(range(1000, 30000), k=rng.randint(10, 60))
        workload.append(Turn(c, list(history[c]), output, 2 if rng.random() < 0.2 else 1))
        history[c] += output
    return workload


def run_demo(num_blocks: int, block_size: int, workload: list[Turn]) -> dict[str, float]:
    cache = KVCache(num_blocks, block_size)
    peak_waste = 0
    for i, turn in enumerate(workload):
        req = f"t{i}"
        cached = cache.add_request(req, turn.prompt)
        cache.append(req, turn.prompt[cached:])
        ids = [req] + [f"{req}.{k}" for k in range(1, turn.samples)]
        for child in ids[1:]:
            cache.fork(req, child)
        for token in turn.output:  # one decode step per token, fenced one step behind
            for rid in ids:
                cache.append(rid, [token])
            peak_waste = max(peak_waste, cache.usage().tail_waste)
            cache.fence(cache.step - 1)
            cache.next_step()
        for rid in ids:
            cache.finish(rid)
    cache.complete_step()
    cache.check_invariants()
    m = cache.metrics.as_dict()
    return {
        "capacity_blocks": num_blocks,
        "token_hit_ratio": m["hit_ratio"],
        "matched_tokens": m["matched_tokens"],
        "evictions": m["evictions"],
        "cow_copies": m["cow_copies"],
        "release_age_p99": m["release_age_p99"],
        "peak_tail_waste": peak_waste,
    }
