"""Seeded request workloads for the server A/B, as conversations of raw prompt text.

- ``system-prompts``: a few long shared system prompts with Zipf popularity, each
  request asking its own question behind one of them (single-turn conversations).
- ``multi-turn``: chats that grow turn by turn; each turn's prompt is the whole history
  (with the server's own earlier answers) plus a new user message.
- ``mixed``: both, interleaved.

Prompt lengths are set in tokens. Text is made of words from a fixed pool, and a token
counter (the model's tokenizer, see `kvplug.serving.tokens`) gives each word's cost, so
lengths hold for any tokenizer up to word-boundary merges. The same name, request count,
seed and counter always give the same workload.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvplug.errors import ConfigError

WORKLOADS = ("system-prompts", "multi-turn", "mixed")

TokenCounter = Callable[[str], int]

# system-prompts
SYSTEM_PROMPTS = 8
SYSTEM_TOKENS = 512
QUESTION_TOKENS = (32, 96)
QUESTION_OUTPUT = 16
ZIPF_EXPONENT = 1.0
# multi-turn
TURNS = 6
OPENING_TOKENS = 256
MESSAGE_TOKENS = (32, 96)
CHAT_OUTPUT = 24

SYSTEM_LABEL = "System:"
USER_LABEL = "User:"
ASSISTANT_LABEL = "Assistant:"

_WORD_TEXT = (
    "the a an of to and in is was for on that with as by at from it this be are or have "
    "not but what all were when we there can which their if will each about how up out "
    "them then she many some so these would other into has more her two like him see time "
    "could no make than first been its who now people my made over did down only way find "
    "use may water long little very after words called just where most know get through "
    "back much before go good new write our used me man too any day same right look think "
    "also around another came come work three word must because does part even place well "
    "such here take why things help put years different away again off went old number "
    "cache block token prefix model layer window memory request page pool hash evict keep "
    "small large fast slow last next every short city road light night world river house "
    "runs reads writes finds gives holds moves sees wants quickly slowly often never always"
)
_WORDS = tuple(_WORD_TEXT.split())


def whitespace_tokens(text: str) -> int:
    """A tokenizer-free stand-in: one token per whitespace-separated word."""
    return len(text.split())


@dataclass(frozen=True)
class Conversation:
    """One client session: `messages` are sent one after another, each turn's prompt being
    `prefix`, the earlier turns with their answers, and the new message."""

    kind: str
    prefix: str
    messages: tuple[str, ...]
    max_tokens: int
    prompt_tokens: int  # estimated tokens of the last turn's prompt, answers included

    def prompt(self, turn: int, answers: Sequence[str]) -> str:
        """The raw prompt text of `turn` (0-based), given the answers to earlier turns."""
        if len(answers) < turn:
            raise ValueError(f"turn {turn} needs {turn} earlier answers, got {len(answers)}")
        history = "".join(
            f"{USER_LABEL} {self.messages[i]}\n{ASSISTANT_LABEL}{answers[i]}\n\n"
            for i in range(turn)
        )
        return f"{self.prefix}{history}{USER_LABEL} {self.messages[turn]}\n{ASSISTANT_LABEL}"


@dataclass(frozen=True)
class Workload:
    name: str
    seed: int
    conversations: tuple[Conversation, ...]

    @property
    def requests(self) -> int:
        return sum(len(c.messages) for c in self.conversations)

    @property
    def max_request_tokens(self) -> int:
        """Estimated tokens of the longest request: its prompt plus its output."""
        return max((c.prompt_tokens + c.max_tokens for c in self.conversations), default=0)

    def describe(self) -> str:
        chats = sum(1 for c in self.conversations if c.kind == "multi-turn")
        singles = len(self.conversations) - chats
        parts = [f"{self.requests} requests"]
        if singles:
            parts.append(f"{singles} behind {SYSTEM_PROMPTS} shared system prompts")
        if chats:
            parts.append(f"{chats} chat{'s' if chats > 1 else ''} of up to {TURNS} turns")
        return f"{self.name}: " + ", ".join(parts)


class _Text:
    """Random word sequences of a given token length, by each word's token cost."""

    def __init__(self, rng: random.Random, count: TokenCounter) -> None:
        self.rng = rng
        self.count = count
        self.costs = [max(1, count(" " + word)) for word in _WORDS]

    def words(self, tokens: int) -> str:
        out: list[str] = []
        used = 0
        while used < tokens:
            i = self.rng.randrange(len(_WORDS))
            out.append(_WORDS[i])
            used += self.costs[i]
        return " ".join(out)

    def length(self, low_high: tuple[int, int]) -> int:
        return self.rng.randint(*low_high)


def build_workload(
    name: str,
    requests: int,
    seed: int = 0,
    count: TokenCounter = whitespace_tokens,
    output_tokens: int | None = None,
) -> Workload:
    """The workload `name` (one of `WORKLOADS`) with `requests` requests in all, each
    answered with up to `output_tokens` tokens (default: the workload's own, 16 for a
    system-prompt question and 24 for a chat turn; 1 makes each request a prefill)."""
    if name not in WORKLOADS:
        raise ConfigError(f"unknown workload {name!r}; accepted: {', '.join(WORKLOADS)}")
    if requests < 1:
        raise ConfigError(f"a workload needs at least 1 request, got {requests}")
    if output_tokens is not None and output_tokens < 1:
        raise ConfigError(f"output tokens must be at least 1, got {output_tokens}")
    rng = random.Random(f"{name}:{seed}")
    text = _Text(rng, count)
    if name == "system-prompts":
        conversations = _system_prompts(text, requests)
    elif name == "multi-turn":
        conversations = _chats(text, requests)
    else:
        singles = _system_prompts(text, requests - requests // 2)
        chats = _chats(text, requests // 2) if requests >= 2 else []
        conversations = _interleave(rng, singles, chats)
    if output_tokens is not None:
        conversations = [_answered_in(c, output_tokens) for c in conversations]
    return Workload(name, seed, tuple(conversations))


def _answered_in(conversation: Conversation, output_tokens: int) -> Conversation:
    """`conversation` with answers of up to `output_tokens` tokens (its prompt estimate
    counts the earlier turns' answers at that length)."""
    turns = len(conversation.messages)
    shift = (turns - 1) * (output_tokens - conversation.max_tokens)
    return replace(
        conversation,
        max_tokens=output_tokens,
        prompt_tokens=max(0, conversation.prompt_tokens + shift),
    )


def _system_prompts(text: _Text, requests: int) -> list[Conversation]:
    label = text.count(f"{SYSTEM_LABEL} \n\n{USER_LABEL} \n{ASSISTANT_LABEL}")
    prompts = [f"{SYSTEM_LABEL} {text.words(SYSTEM_TOKENS)}\n\n" for _ in range(SYSTEM_PROMPTS)]
    weights = [1 / (k + 1) ** ZIPF_EXPONENT for k in range(SYSTEM_PROMPTS)]
    out = []
    for _ in range(requests):
        prefix = text.rng.choices(prompts, weights)[0]
        tokens = text.length(QUESTION_TOKENS)
        question = text.words(tokens)
        estimate = SYSTEM_TOKENS + tokens + label
        out.append(Conversation("system-prompts", prefix, (question,), QUESTION_OUTPUT, estimate))
    return out


def _chats(text: _Text, requests: int) -> list[Conversation]:
    label = text.count(f"{USER_LABEL} \n{ASSISTANT_LABEL}\n\n")
    out = []
    left = requests
    while left > 0:
        turns = min(TURNS, left)
        left -= turns
        lengths = [OPENING_TOKENS] + [text.length(MESSAGE_TOKENS) for _ in range(turns - 1)]
        messages = tuple(text.words(n) for n in lengths)
        estimate = sum(lengths) + (turns - 1) * CHAT_OUTPUT + turns * label
        out.append(Conversation("multi-turn", "", messages, CHAT_OUTPUT, estimate))
    return out


def _interleave(
    rng: random.Random, first: list[Conversation], second: list[Conversation]
) -> list[Conversation]:
    """Both lists merged in a seeded random order that keeps each list's own order."""
    slots = [0] * len(first) + [1] * len(second)
    rng.shuffle(slots)
    sources = [iter(first), iter(second)]
    return [next(sources[s]) for s in slots]
