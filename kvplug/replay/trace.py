"""Request traces: the Mooncake and Alibaba Bailian JSON-lines formats.

A trace names each prompt's blocks by id instead of carrying tokens:

- Mooncake (FAST '25): ``{"timestamp": ms, "input_length", "output_length", "hash_ids"}``,
  one id per 512-token block. Ids are prefix-chained: the same id means the same block
  *and* the same whole prefix before it, so an id always follows the same parent.
- Bailian: ``{"chat_id", "parent_chat_id", "timestamp": s, "input_length",
  "output_length", "type", "turn", "hash_ids"}``, one id per 16-token block. `chat_id`
  names the request and `parent_chat_id` the previous turn of its conversation (-1 for a
  first turn); a request's `session` is the chat id of its conversation's first turn.

Every problem is a `TraceError` naming the line and what is wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from kvplug.errors import KVPlugError

FORMATS = ("mooncake", "bailian")
BLOCK_TOKENS = {"mooncake": 512, "bailian": 16}  # tokens per hash id, by format
_FIELDS = {
    "mooncake": ("timestamp", "input_length", "output_length", "hash_ids"),
    "bailian": ("chat_id", "timestamp", "input_length", "output_length", "hash_ids"),
}


class TraceError(KVPlugError, ValueError):
    """A trace line that cannot be replayed."""


class BlockCount(NamedTuple):
    """How many blocks of a fixed size some tokens take."""

    full: int  # blocks the tokens fill completely
    total: int  # the full blocks, plus one for a partial last block if there is one

    @property
    def has_partial(self) -> bool:
        return self.total > self.full


def count_blocks(tokens: int, block_tokens: int) -> BlockCount:
    """The one rule for tokens per block in the replay: `tokens` in blocks of `block_tokens`.

    A prompt of `tokens` tokens has `total` hash ids; only its `full` blocks can be shared,
    a partial last block holding content that no other prompt has.
    """
    return BlockCount(tokens // block_tokens, -(-tokens // block_tokens))


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival: float  # seconds from the trace's start
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session: str = ""  # conversation or chat id, when the trace has one
    turn: int = 0  # the request's turn in its conversation (1 = first), when known
    retain_s: float = 0.0  # seconds its prompt's prefix is asked to be kept (0: not asked)


@dataclass(frozen=True)
class Trace:
    name: str
    block_tokens: int  # tokens per hash id
    requests: list[TraceRequest]

    @property
    def prompt_blocks(self) -> int:
        return sum(len(request.hash_ids) for request in self.requests)

    @property
    def distinct_blocks(self) -> int:
        """Distinct blocks, a block being its id together with every id before it."""
        nodes: dict[tuple[int, int], int] = {}  # (parent node, block id) -> node
        for request in self.requests:
            parent = -1
            for block_id in request.hash_ids:
                parent = nodes.setdefault((parent, block_id), len(nodes))
        return len(nodes)


def read_trace(path: str | Path, fmt: str | None = None) -> Trace:
    """Read a JSON-lines trace; the format is detected from the first line unless given."""
    path = Path(path)
    if fmt is not None and fmt not in FORMATS:
        raise TraceError(f"unknown trace format {fmt!r}; accepted: {', '.join(FORMATS)}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise TraceError(f"cannot read trace {str(path)!r}: {exc.strerror or exc}") from None
    requests: list[TraceRequest] = []
    parents: dict[int, tuple[int | None, int]] = {}  # id -> (parent id, line first seen)
    conversation: dict[str, str] = {}  # Bailian chat id -> its conversation's first chat id
    start: float | None = None
    last_time = float("-inf")
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path.name}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: invalid JSON at column {exc.colno}: {exc.msg}") from None
        if not isinstance(row, dict):
            raise TraceError(f"{where}: each line must be a JSON object")
        if fmt is None:
            fmt = "bailian" if "chat_id" in row else "mooncake"
        missing = [f for f in _FIELDS[fmt] if f not in row]
        if missing:
            raise TraceError(
                f"{where}: missing field {missing[0]!r} ({fmt} lines need "
                f"{', '.join(_FIELDS[fmt])})"
            )
        seconds = _number(row["timestamp"], "timestamp", where)
        seconds = seconds / 1000 if fmt == "mooncake" else seconds
        if seconds < last_time:
            raise TraceError(
                f"{where}: timestamp {row['timestamp']} is earlier than the line before it; "
                "timestamps must not decrease"
            )
        last_time = seconds
        start = seconds if start is None else start
        input_length = _count(row["input_length"], "input_length", where, minimum=1)
        output_length = _count(row["output_length"], "output_length", where, minimum=0)
        ids = row["hash_ids"]
        if not isinstance(ids, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) for h in ids
        ):
            raise TraceError(f"{where}: 'hash_ids' must be a list of integers")
        expected = count_blocks(input_length, BLOCK_TOKENS[fmt]).total
        if len(ids) != expected:
            raise TraceError(
                f"{where}: {len(ids)} hash_ids for input_length {input_length}; "
                f"{fmt} blocks hold {BLOCK_TOKENS[fmt]} tokens, so {expected} are needed"
            )
        if fmt == "mooncake":
            _check_chain(ids, parents, where, lineno)
        session, turn = "", 0
        if fmt == "bailian":
            chat = str(row["chat_id"])
            parent = str(row.get("parent_chat_id", -1))
            session = conversation[chat] = conversation.get(parent, chat)
            turn = _count(row.get("turn", 0), "turn", where, minimum=0)
        requests.append(
            TraceRequest(seconds - start, input_length, output_length, tuple(ids), session, turn)
        )
    if not requests:
        raise TraceError(f"{path}: the trace has no requests")
    assert fmt is not None
    return Trace(path.stem, BLOCK_TOKENS[fmt], requests)


def _check_chain(
    ids: list[int], parents: dict[int, tuple[int | None, int]], where: str, lineno: int
) -> None:
    parent: int | None = None
    for position, block_id in enumerate(ids):
        first_parent, first_line = parents.setdefault(block_id, (parent, lineno))
        if first_parent != parent:
            before = "the start of the prompt" if parent is None else f"id {parent}"
            then = "the start of the prompt" if first_parent is None else f"id {first_parent}"
            raise TraceError(
                f"{where}: hash id {block_id} at block {position} follows {before}, but on line "
                f"{first_line} it follows {then}; Mooncake ids must be prefix-chained"
            )
        parent = block_id


def _number(value: object, name: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TraceError(f"{where}: {name!r} must be a number, got {value!r}")
    return float(value)


def _count(value: object, name: str, where: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceError(f"{where}: {name!r} must be an integer >= {minimum}, got {value!r}")
    return value


def write_trace(trace: Trace, path: str | Path, fmt: str = "mooncake") -> Path:
    """Write `trace` as JSON lines: Mooncake (timestamps in ms; needs 512-token blocks) or
    Bailian (timestamps in s; each block id becomes one id per 16 tokens, and requests
    with the same `session` are chained as turns of one conversation)."""
    if fmt not in FORMATS:
        raise TraceError(f"unknown trace format {fmt!r}; accepted: {', '.join(FORMATS)}")
    if fmt == "mooncake" and trace.block_tokens != BLOCK_TOKENS["mooncake"]:
        raise TraceError(
            f"Mooncake traces use {BLOCK_TOKENS['mooncake']}-token blocks, not {trace.block_tokens}"
        )
    if trace.block_tokens % BLOCK_TOKENS["bailian"]:
        raise TraceError(f"blocks of {trace.block_tokens} tokens cannot be split into 16s")
    path = Path(path)
    last_chat: dict[str, int] = {}  # session -> chat id of its latest turn
    with path.open("w", encoding="utf-8") as out:
        for chat_id, request in enumerate(trace.requests):
            if fmt == "mooncake":
                row: dict = {"timestamp": round(request.arrival * 1000)}
            else:
                parent = last_chat.get(request.session, -1) if request.session else -1
                if request.session:
                    last_chat[request.session] = chat_id
                row = {"chat_id": chat_id, "parent_chat_id": parent, "timestamp": request.arrival}
                row |= {"type": "text", "turn": request.turn or 1}
            row["input_length"] = request.input_length
            row["output_length"] = request.output_length
            row["hash_ids"] = _split_ids(request, trace.block_tokens, BLOCK_TOKENS[fmt])
            out.write(json.dumps(row) + "\n")
    return path


def _split_ids(request: TraceRequest, block_tokens: int, tokens: int) -> list[int]:
    """The request's ids for blocks of `tokens` tokens: block id b becomes b*k .. b*k+k-1."""
    k = block_tokens // tokens
    if k == 1:
        return list(request.hash_ids)
    ids = [h * k + j for h in request.hash_ids for j in range(k)]
    return ids[: -(-request.input_length // tokens)]
