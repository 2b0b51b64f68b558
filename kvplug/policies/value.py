"""What keeping one cached block saves: the prefill FLOPs of its tokens at its depth."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvplug.core.model_spec import ModelSpec, load_model
from kvplug.policies.reload import HostLink

if TYPE_CHECKING:
    from kvplug.policies.node import CachedNode


class BlockValue:
    """Prefill FLOPs a cached block saves, relative to a block at position 0.

    Deeper blocks are worth more: their tokens attend to more context. `tokens_per_block`
    defaults to the cache's block size (`bind`); trace replays, whose cache blocks each
    stand for a whole trace block, set it explicitly.
    """

    def __init__(self, model: str | ModelSpec | None = None, tokens_per_block: int | None = None):
        self.model = model if isinstance(model, ModelSpec) else load_model(model)
        self.tokens_per_block = tokens_per_block
        self.by_depth: list[float] = []  # the value at each depth computed so far

    def bind(self, block_size: int) -> None:
        if self.tokens_per_block is None:
            self.tokens_per_block = block_size

    def __call__(self, node: CachedNode) -> float:
        return self.at_depth(node.depth)

    def at_depth(self, depth: int) -> float:
        """The value of a block at `depth` (computed once, then read from `by_depth`)."""
        if depth < len(self.by_depth):
            return self.by_depth[depth]
        while len(self.by_depth) <= depth:
            t = self.tokens_per_block or 1
            d = len(self.by_depth)
            flops = self.model.prefill_flops(d * t, (d + 1) * t)
            self.by_depth.append(flops / self.model.prefill_flops(0, t))
        return self.by_depth[depth]

    def reload(self, link: HostLink) -> float:
        """What a block another tier holds costs to bring back over `link`, in the same
        units (the prefill FLOPs of a block at position 0)."""
        t = self.tokens_per_block or 1
        return link.reload_flops(self.model, t) / self.model.prefill_flops(0, t)
