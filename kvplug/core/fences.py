"""Steps and fences: when a block that a request let go of may be reused.

Work is issued in numbered steps; the caller reports with ``fence(f)`` that every step up
to ``f`` has finished reading and writing. Two things wait for a fence:

- *pending writes*: a block filled in step ``s`` is sealed (and published) only at the
  fence of ``s``, in the order blocks were filled;
- *draining blocks*: a block released while a step that read or wrote it is unfenced
  waits until that step's fence before the cache settles it (frees it, or offers it to
  the eviction policy).

`StepClock` only keeps the steps and the two queues; `kvplug.core.cache.KVCache` decides
what a completed write or a drained block becomes.

Invariants: ``last_fence < step`` (the step being issued is never fenced); pending writes
come out in the order they were filled; a block is returned by `drained` only once no
unfenced step can touch it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from heapq import heappop, heappush
from itertools import count
from typing import TYPE_CHECKING, Generic, NamedTuple, TypeVar

from kvplug.errors import FenceError

if TYPE_CHECKING:
    from kvplug.core.pool import Block

R = TypeVar("R")


class PendingWrite(NamedTuple, Generic[R]):
    """A full block whose write is in flight, to seal and publish at its fence."""

    step: int
    request: R
    index: int  # position of the block in the request's table


class StepClock(Generic[R]):
    """The step being issued, the last fence, and what waits for a fence."""

    def __init__(self) -> None:
        self.step = 1  # the step being issued
        self.last_fence = 0  # every step <= last_fence is finished
        self._pending: deque[PendingWrite[R]] = deque()
        # (busy until step, tie-breaker, block): released blocks waiting for a fence
        self._draining: list[tuple[int, int, Block]] = []
        self._drain_order = count()

    @staticmethod
    def busy_step(block: Block) -> int:
        """The last step that may read or write `block`."""
        return max(block.busy_until, block.write_step)

    def busy(self, block: Block) -> bool:
        """Whether an unfenced step may still read or write `block`."""
        return self.busy_step(block) > self.last_fence

    def write_pending(self, request: R, index: int) -> None:
        """The current step fills block `index` of `request`'s table."""
        self._pending.append(PendingWrite(self.step, request, index))

    def wait_for_fence(self, block: Block) -> None:
        """Hold a released `block` back until the fence of its last busy step."""
        heappush(self._draining, (self.busy_step(block), next(self._drain_order), block))

    def next_step(self) -> int:
        self.step += 1
        return self.step

    def fence(self, step: int) -> list[PendingWrite[R]]:
        """Record that steps up to `step` are finished; return the writes they completed,
        in the order they were filled. Raises `FenceError`, changing nothing, for a fence
        older than the last one or for a step not issued yet."""
        if step < self.last_fence:
            raise FenceError(f"fence {step} is older than fence {self.last_fence} already seen")
        if step > self.step:
            raise FenceError(f"fence {step} names a step not issued yet (current step {self.step})")
        self.last_fence = step
        if step == self.step:
            self.step += 1
        done: list[PendingWrite[R]] = []
        while self._pending and self._pending[0].step <= step:
            done.append(self._pending.popleft())
        return done

    def drained(self) -> Iterator[Block]:
        """Blocks whose wait is over at the last fence (call after `fence`)."""
        while self._draining and self._draining[0][0] <= self.last_fence:
            yield heappop(self._draining)[2]
