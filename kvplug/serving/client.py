"""Send a workload to an OpenAI-compatible server and time each streamed completion.

Every request is a streamed ``POST /v1/completions`` with the raw prompt text,
``stream_options.include_usage`` (so the last chunk carries ``usage``, with
``prompt_tokens_details.cached_tokens`` when the server reports it) and ``ignore_eos``
(so outputs have their set length). TTFT is the time from sending the request to the
first chunk that carries a generated token. A conversation's turns go one after another,
each resending the history with the server's answers; up to `concurrency` conversations
run at once (a chat keeps its slot between turns, like a user in a session), so at most
that many requests are in flight. aiohttp is imported only here, when sending.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from kvplug.serving.workload import Conversation, Workload

SKIPPED = "skipped: an earlier turn of this conversation failed"


@dataclass
class RequestResult:
    conversation: int
    turn: int
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    text: str = ""
    sent_at: float = 0.0  # time.perf_counter() when the request was sent


@dataclass
class RunResult:
    results: list[RequestResult]
    wall_s: float


@dataclass
class StreamState:
    """What the server-sent events of one streamed completion said so far."""

    started: float
    first_token: float | None = None
    parts: list[str] = field(default_factory=list)
    usage: dict | None = None
    error: str = ""
    done: bool = False

    def feed(self, line: bytes | str, now: float) -> None:
        """Take one line of the event stream, received at `now`."""
        if isinstance(line, bytes):
            line = line.decode("utf-8", "replace")
        line = line.strip()
        if not line.startswith("data:"):
            return
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            self.error = f"bad event: {data[:200]}"
            return
        if "error" in chunk:
            self.error = f"server error: {json.dumps(chunk['error'])[:300]}"
            return
        choices = chunk.get("choices") or []
        if choices and self.first_token is None:
            self.first_token = now
        self.parts.extend(choice.get("text") or "" for choice in choices)
        if chunk.get("usage"):
            self.usage = chunk["usage"]

    def result(self, conversation: int, turn: int, now: float) -> RequestResult:
        out = RequestResult(conversation, turn, latency_s=now - self.started)
        out.sent_at = self.started
        out.text = "".join(self.parts)
        if self.error:
            out.error = self.error
        elif self.usage is None:
            out.error = "the stream ended without usage"
        elif self.first_token is None:
            out.error = "the stream carried no token"
        else:
            details = self.usage.get("prompt_tokens_details") or {}
            out.ok = True
            out.prompt_tokens = int(self.usage.get("prompt_tokens") or 0)
            out.completion_tokens = int(self.usage.get("completion_tokens") or 0)
            out.cached_tokens = int(details.get("cached_tokens") or 0)
            out.ttft_s = self.first_token - self.started
        return out


def request_body(model: str, prompt: str, max_tokens: int, seed: int = 0) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "seed": seed,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _complete(session, url: str, body: dict, conversation: int, turn: int) -> RequestResult:
    import aiohttp

    state = StreamState(time.perf_counter())
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                text = (await response.text())[:300]
                state.error = f"HTTP {response.status}: {text}"
            else:
                async for line in response.content:
                    state.feed(line, time.perf_counter())
                    if state.done or state.error:
                        break
    except (TimeoutError, aiohttp.ClientError) as exc:
        state.error = f"{type(exc).__name__}: {exc}"
    return state.result(conversation, turn, time.perf_counter())


async def _conversation(
    session,
    url: str,
    model: str,
    index: int,
    conversation: Conversation,
    slots: asyncio.Semaphore,
    seed: int,
) -> list[RequestResult]:
    """Send the turns of one conversation in order; it holds one of the `slots` from its
    first turn to its last, like a user in a session."""
    answers: list[str] = []
    results: list[RequestResult] = []
    async with slots:
        for turn in range(len(conversation.messages)):
            if results and not results[-1].ok:
                results.append(RequestResult(index, turn, error=SKIPPED))
                continue
            prompt = conversation.prompt(turn, answers)
            body = request_body(model, prompt, conversation.max_tokens, seed)
            result = await _complete(session, url, body, index, turn)
            answers.append(result.text)
            results.append(result)
    return results


async def run_workload_async(
    base_url: str,
    model: str,
    workload: Workload,
    *,
    concurrency: int = 8,
    request_timeout_s: float = 300.0,
    seed: int = 0,
) -> RunResult:
    """Send every conversation of `workload`, `concurrency` conversations at a time (so at
    most that many requests in flight), in the workload's order."""
    import aiohttp

    url = f"{base_url}/v1/completions"
    slots = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        started = time.perf_counter()
        per_conversation = await asyncio.gather(
            *(
                _conversation(session, url, model, i, conv, slots, seed)
                for i, conv in enumerate(workload.conversations)
            )
        )
        wall = time.perf_counter() - started
    return RunResult([r for results in per_conversation for r in results], wall)


def run_workload(base_url: str, model: str, workload: Workload, **options) -> RunResult:
    """`run_workload_async` from synchronous code."""
    return asyncio.run(run_workload_async(base_url, model, workload, **options))


def warm_up(base_url: str, model: str, *, timeout_s: float = 120.0) -> RequestResult:
    """One short request, so one-time costs of the first request do not count in TTFT."""
    warm = Workload("warm-up", 0, (Conversation("warm-up", "", ("hello",), 2, 4),))
    result = run_workload(base_url, model, warm, concurrency=1, request_timeout_s=timeout_s)
    return result.results[0]
