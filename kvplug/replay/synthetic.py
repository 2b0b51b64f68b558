"""Seeded synthetic workloads with different reuse shapes, as Mooncake-style traces.

- ``system-prompts``: a few shared system prompts with Zipf popularity, each request
  adding its own question. Reuse is shallow and frequent.
- ``multi-turn``: chats whose every turn resends the whole history plus the last answer
  and a new message, after a human think time. Reuse is deep, long-gapped and per chat.
- ``agent-loop``: agents behind one long shared tool prompt that append tool output and
  a short model step, seconds apart. Reuse is deep, frequent and fast-growing.
- ``mixed``: all three at once.

Blocks hold `BLOCK_TOKENS` tokens and get fresh ids for fresh content, so ids are
prefix-chained like Mooncake's.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from kvplug.errors import KVPlugError
from kvplug.replay.trace import Trace, TraceRequest

BLOCK_TOKENS = 512


@dataclass
class _Ids:
    next_id: int = 0

    def fresh(self, n: int) -> list[int]:
        start = self.next_id
        self.next_id += n
        return list(range(start, start + n))


@dataclass
class _Context:
    """A growing prompt: the ids of its full blocks and how many tokens it holds."""

    blocks: list[int] = field(default_factory=list)
    tokens: int = 0

    def extend(self, tokens: int, ids: _Ids) -> TraceRequest:
        """Add `tokens` (fresh content); return the request that sends the result.

        The old partial block (if any) now holds different tokens, so it gets a new id.
        """
        full = self.tokens // BLOCK_TOKENS
        self.tokens += tokens
        total = -(-self.tokens // BLOCK_TOKENS)
        self.blocks = self.blocks[:full] + ids.fresh(total - full)
        return TraceRequest(0.0, self.tokens, 0, tuple(self.blocks))


def _request(ctx: _Context, extra: int, ids: _Ids, at: float, output: int) -> TraceRequest:
    req = ctx.extend(extra, ids)
    return TraceRequest(at, req.input_length, output, req.hash_ids)


def system_prompts(rng: random.Random, duration: float, rate: float, ids: _Ids) -> list:
    prompts = [_Context() for _ in range(12)]
    for p in prompts:
        p.extend(rng.randint(2, 16) * BLOCK_TOKENS, ids)
    weights = [1 / (k + 1) ** 1.1 for k in range(len(prompts))]
    out, t = [], 0.0
    while (t := t + rng.expovariate(rate)) < duration:
        base = rng.choices(prompts, weights)[0]
        ctx = _Context(list(base.blocks), base.tokens)
        out.append(_request(ctx, rng.randint(50, 3000), ids, t, rng.randint(50, 400)))
    return out


def multi_turn(rng: random.Random, duration: float, rate: float, ids: _Ids) -> list:
    out, t = [], 0.0
    while (t := t + rng.expovariate(rate / 4)) < duration:  # about 4 turns per chat
        ctx, at, last_answer = _Context(), t, 0
        while at < duration:
            message = last_answer + rng.randint(100, 4000)  # the previous answer, a new message
            answer = rng.randint(100, 600)
            out.append(_request(ctx, message, ids, at, answer))
            if rng.random() < 0.25:
                break
            at += rng.expovariate(1 / 45.0) + answer / 40.0  # reading the answer, typing
            last_answer = answer
    return out


def agent_loop(rng: random.Random, duration: float, rate: float, ids: _Ids) -> list:
    tools = _Context()
    tools.extend(24 * BLOCK_TOKENS, ids)
    out, t = [], 0.0
    while (t := t + rng.expovariate(rate / 15)) < duration:  # about 15 steps per agent
        ctx, at, step = _Context(list(tools.blocks), tools.tokens), t, 0
        extra = rng.randint(200, 2000)  # the task
        while at < duration and step < 60:
            output = rng.randint(10, 80)
            out.append(_request(ctx, extra, ids, at, output))
            extra = output + rng.randint(300, 6000)  # the step, then the tool's output
            at += rng.uniform(1.0, 8.0)
            step += 1
            if rng.random() < 0.07:
                break
    return out


GENERATORS: dict[str, Callable[[random.Random, float, float, _Ids], list]] = {
    "system-prompts": system_prompts,
    "multi-turn": multi_turn,
    "agent-loop": agent_loop,
}


def synthetic_trace(
    name: str, *, seed: int = 0, duration: float = 600.0, rate: float = 4.0
) -> Trace:
    """A named workload: `rate` requests per second for `duration` seconds, seeded."""
    if name != "mixed" and name not in GENERATORS:
        raise KVPlugError(
            f"unknown synthetic workload {name!r}; accepted: {', '.join(GENERATORS)}, mixed"
        )
    rng, ids = random.Random(seed), _Ids()
    names = list(GENERATORS) if name == "mixed" else [name]
    requests = []
    for part in names:
        requests += GENERATORS[part](rng, duration, rate / len(names), ids)
    requests.sort(key=lambda r: r.arrival)
    return Trace(f"synthetic-{name}", BLOCK_TOKENS, requests)


SYNTHETIC_NAMES = (*GENERATORS, "mixed")
