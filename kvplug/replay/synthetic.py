"""Seeded synthetic workloads with different reuse shapes, as Mooncake-style traces.

- ``system-prompts``: a few shared system prompts with Zipf popularity, each request
  adding its own question. Reuse is shallow and frequent.
- ``multi-turn``: chats whose every turn resends the whole history plus the last answer
  and a new message, after a human think time. Reuse is deep, long-gapped and per chat.
  Each request names its chat as its session (``chat-N``) and its turn.
- ``agent-loop``: agents behind one long shared tool prompt that append tool output and
  a short model step, seconds apart. Reuse is deep, frequent and fast-growing. Each
  request names its agent as its session (``agent-N``) and its step as its turn.
- ``multi-adapter``: many LoRA adapters with Zipf popularity, each with its own system
  prompt. A block computed under one adapter is not a hit under another, so each adapter
  has its own ids; popular adapters' prompts are reused, the tail's rarely.
- ``conversations``: chats with conversation ids and turn numbers (as Alibaba's Bailian
  traces carry them): each turn resends the history, after a log-normal think time
  (median 30 s, long tail) or, one time in five, a long pause (median 10 minutes).
- ``bursts``: a few hot system prompts asked all along (each request adding its own
  question; session ``hot-K`` for prompt K), under floods of one-off long prompts, a
  flood every minute or so, enough to wash a small cache out.
- ``hot-prompts``: the same hot requests without the floods (the same seed gives the same
  hot requests, ids and times), what the hot prompts' hits are without the bursts.
- ``mixed``: the first three at once (the bundled trace, which keeps no session ids): the
  one-off questions to system prompts name no session, the chats and agents do.
- ``served-chats``: the chats ``kvplug bench serve --workload multi-turn`` sends, as its
  fleet commands run it (300 requests, 8 in flight), so that the fleet replay predicts
  the live fleet A/B: 50 chats of `TURNS` turns, an opening of `OPENING_TOKENS` and then
  messages of `MESSAGE_TOKENS`, each turn resending the history with the previous
  `CHAT_OUTPUT`-token answer; a chat's next turn goes out about `SERVED_TURN_S` after
  the last (the live requests' time), and a chat starts when one of the client's slots
  frees. Blocks hold the A/B's 32 tokens; its size is fixed (duration and rate do not
  apply).

Blocks hold `BLOCK_TOKENS` tokens and get fresh ids for fresh content, so ids are
prefix-chained like Mooncake's.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from kvplug.errors import KVPlugError
from kvplug.replay.trace import BLOCK_TOKENS as TRACE_BLOCK_TOKENS
from kvplug.replay.trace import Trace, TraceRequest, count_blocks
from kvplug.serving.workload import CHAT_OUTPUT, MESSAGE_TOKENS, OPENING_TOKENS, TURNS

BLOCK_TOKENS = TRACE_BLOCK_TOKENS["mooncake"]


@dataclass
class _BlockIds:
    """Hands out block ids never used before."""

    next_id: int = 0

    def fresh(self, count: int) -> list[int]:
        start = self.next_id
        self.next_id += count
        return list(range(start, start + count))


@dataclass
class _Context:
    """A growing prompt: the ids of its full blocks and how many tokens it holds."""

    blocks: list[int] = field(default_factory=list)
    tokens: int = 0
    block_tokens: int = BLOCK_TOKENS

    def extend(self, tokens: int, ids: _BlockIds) -> TraceRequest:
        """Add `tokens` (fresh content); return the request that sends the result.

        The old partial block (if any) now holds different tokens, so it gets a new id.
        """
        kept = count_blocks(self.tokens, self.block_tokens).full
        self.tokens += tokens
        total = count_blocks(self.tokens, self.block_tokens).total
        self.blocks = self.blocks[:kept] + ids.fresh(total - kept)
        return TraceRequest(0.0, self.tokens, 0, tuple(self.blocks))


def _request(
    context: _Context,
    extra: int,
    ids: _BlockIds,
    at: float,
    output: int,
    session: str = "",
    turn: int = 0,
) -> TraceRequest:
    """`context` extended by `extra` fresh tokens, sent at `at` for `output` tokens, as
    turn `turn` of `session` (none by default)."""
    extended = context.extend(extra, ids)
    return TraceRequest(at, extended.input_length, output, extended.hash_ids, session, turn)


# A workload: (rng, duration s, rate per s, ids) -> its requests, in any order.
WorkloadGenerator = Callable[[random.Random, float, float, _BlockIds], list[TraceRequest]]


def system_prompts(
    rng: random.Random, duration: float, rate: float, ids: _BlockIds
) -> list[TraceRequest]:
    prompts = [_Context() for _ in range(12)]
    for prompt in prompts:
        prompt.extend(rng.randint(2, 16) * BLOCK_TOKENS, ids)
    weights = [1 / (rank + 1) ** 1.1 for rank in range(len(prompts))]
    requests, now = [], 0.0
    while (now := now + rng.expovariate(rate)) < duration:
        base = rng.choices(prompts, weights)[0]
        context = _Context(list(base.blocks), base.tokens)
        requests.append(_request(context, rng.randint(50, 3000), ids, now, rng.randint(50, 400)))
    return requests


def multi_turn(
    rng: random.Random, duration: float, rate: float, ids: _BlockIds
) -> list[TraceRequest]:
    requests, chat, chats = [], 0.0, 0  # chat: when the current chat starts
    while (chat := chat + rng.expovariate(rate / 4)) < duration:  # about 4 turns per chat
        context, at, last_answer, chats, turn = _Context(), chat, 0, chats + 1, 0
        while at < duration:
            message = last_answer + rng.randint(100, 4000)  # the previous answer, a new message
            answer = rng.randint(100, 600)
            turn += 1
            requests.append(_request(context, message, ids, at, answer, f"chat-{chats}", turn))
            if rng.random() < 0.25:
                break
            at += rng.expovariate(1 / 45.0) + answer / 40.0  # reading the answer, typing
            last_answer = answer
    return requests


def agent_loop(
    rng: random.Random, duration: float, rate: float, ids: _BlockIds
) -> list[TraceRequest]:
    tools = _Context()
    tools.extend(24 * BLOCK_TOKENS, ids)
    requests, agent, agents = [], 0.0, 0  # agent: when the current agent starts
    while (agent := agent + rng.expovariate(rate / 15)) < duration:  # about 15 steps per agent
        context, at, step = _Context(list(tools.blocks), tools.tokens), agent, 0
        extra, agents = rng.randint(200, 2000), agents + 1  # the task
        while at < duration and step < 60:
            output = rng.randint(10, 80)
            session = f"agent-{agents}"
            requests.append(_request(context, extra, ids, at, output, session, step + 1))
            extra = output + rng.randint(300, 6000)  # the step, then the tool's output
            at += rng.uniform(1.0, 8.0)
            step += 1
            if rng.random() < 0.07:
                break
    return requests


def multi_adapter(
    rng: random.Random, duration: float, rate: float, ids: _BlockIds
) -> list[TraceRequest]:
    adapters = 64
    weights = [1 / (k + 1) ** 1.2 for k in range(adapters)]
    prompts: dict[int, _Context] = {}  # built when an adapter is first used
    out, t = [], 0.0
    while (t := t + rng.expovariate(rate)) < duration:
        adapter = rng.choices(range(adapters), weights)[0]
        if adapter not in prompts:
            prompts[adapter] = _Context()
            prompts[adapter].extend(rng.randint(2, 12) * BLOCK_TOKENS, ids)
        base = prompts[adapter]
        context = _Context(list(base.blocks), base.tokens)
        question = rng.randint(50, 2500)
        out.append(_request(context, question, ids, t, rng.randint(20, 400), f"adapter-{adapter}"))
    return out


def conversations(
    rng: random.Random, duration: float, rate: float, ids: _BlockIds
) -> list[TraceRequest]:
    out, t, chats = [], 0.0, 0
    while (t := t + rng.expovariate(rate / 3)) < duration:  # about 3 turns per chat
        context, at, last_answer, chats = _Context(), t, 0, chats + 1
        system = rng.randint(1, 4) * BLOCK_TOKENS if rng.random() < 0.5 else 0
        for turn in range(1, 41):
            message = system + last_answer + rng.randint(30, 1500)
            system, answer = 0, rng.randint(50, 800)
            out.append(_request(context, message, ids, at, answer, f"chat-{chats}", turn))
            if at >= duration or rng.random() < 0.3:
                break
            pause = rng.lognormvariate(6.4, 0.8) if rng.random() < 0.2 else 0.0
            at += answer / 40.0 + rng.lognormvariate(3.4, 0.9) + pause
            last_answer = answer
    return [r for r in out if r.arrival < duration]


HOT_PROMPTS = 4
HOT_SHARE = 0.5  # of the requests, without the floods


def hot_prompts(
    rng: random.Random, duration: float, rate: float, ids: _BlockIds
) -> list[TraceRequest]:
    """`HOT_PROMPTS` system prompts of 8-16 blocks, equally popular, asked at `HOT_SHARE`
    of `rate` (the hot stream `bursts` floods)."""
    prompts = [_Context() for _ in range(HOT_PROMPTS)]
    for prompt in prompts:
        prompt.extend(rng.randint(8, 16) * BLOCK_TOKENS, ids)
    requests, now = [], 0.0
    while (now := now + rng.expovariate(rate * HOT_SHARE)) < duration:
        k = rng.randrange(HOT_PROMPTS)
        context = _Context(list(prompts[k].blocks), prompts[k].tokens)
        requests.append(
            _request(context, rng.randint(50, 1500), ids, now, rng.randint(50, 300), f"hot-{k}")
        )
    return requests


def bursts(rng: random.Random, duration: float, rate: float, ids: _BlockIds) -> list[TraceRequest]:
    requests = hot_prompts(rng, duration, rate, ids)  # first: the same hot requests
    flood = 0.0
    while (flood := flood + rng.uniform(40.0, 80.0)) < duration:
        for _ in range(rng.randint(12, 24)):  # one-off long prompts, within seconds
            at = flood + rng.uniform(0.0, 5.0)
            tokens = rng.randint(16, 48) * BLOCK_TOKENS + rng.randint(0, BLOCK_TOKENS - 1)
            requests.append(_request(_Context(), tokens, ids, at, rng.randint(20, 200)))
    return [r for r in requests if r.arrival < duration]


GENERATORS: dict[str, WorkloadGenerator] = {
    "system-prompts": system_prompts,
    "multi-turn": multi_turn,
    "agent-loop": agent_loop,
    "multi-adapter": multi_adapter,
    "conversations": conversations,
    "bursts": bursts,
    "hot-prompts": hot_prompts,
}
MIXED = ("system-prompts", "multi-turn", "agent-loop")


SERVED_CHATS = "served-chats"
SERVED_BLOCK_TOKENS = 32  # the server A/B's KV blocks
SERVED_REQUESTS = 300
SERVED_CONCURRENCY = 8
SERVED_TURN_S = 1.0


def served_chats(rng: random.Random) -> list[TraceRequest]:
    """The ``served-chats`` workload (module docstring), in arrival order of its chats."""
    ids = _BlockIds()
    free_at = [0.0] * SERVED_CONCURRENCY  # when each of the client's slots frees
    requests: list[TraceRequest] = []
    left, chats = SERVED_REQUESTS, 0
    while left > 0:
        turns, chats = min(TURNS, left), chats + 1
        left -= turns
        slot = min(range(SERVED_CONCURRENCY), key=free_at.__getitem__)
        context, at = _Context(block_tokens=SERVED_BLOCK_TOKENS), free_at[slot]
        lengths = [OPENING_TOKENS] + [rng.randint(*MESSAGE_TOKENS) for _ in range(turns - 1)]
        for turn, message in enumerate(lengths, 1):
            extra = message + (CHAT_OUTPUT if turn > 1 else 0)  # the last answer, a message
            requests.append(_request(context, extra, ids, at, CHAT_OUTPUT, f"chat-{chats}", turn))
            at += SERVED_TURN_S * rng.uniform(0.8, 1.2)
        free_at[slot] = at
    return requests


def synthetic_trace(
    name: str, *, seed: int = 0, duration: float = 600.0, rate: float = 4.0
) -> Trace:
    """A named workload: `rate` requests per second for `duration` seconds, seeded
    (``served-chats``: its own fixed size)."""
    if name == SERVED_CHATS:
        requests = sorted(served_chats(random.Random(seed)), key=lambda r: r.arrival)
        return Trace(f"synthetic-{name}", SERVED_BLOCK_TOKENS, requests)
    if name != "mixed" and name not in GENERATORS:
        raise KVPlugError(
            f"unknown synthetic workload {name!r}; accepted: {', '.join(SYNTHETIC_NAMES)}"
        )
    rng, ids = random.Random(seed), _BlockIds()
    names = list(MIXED) if name == "mixed" else [name]
    requests = []
    for part in names:
        requests += GENERATORS[part](rng, duration, rate / len(names), ids)
    requests.sort(key=lambda request: request.arrival)
    return Trace(f"synthetic-{name}", BLOCK_TOKENS, requests)


SYNTHETIC_NAMES = (*GENERATORS, "mixed", SERVED_CHATS)
