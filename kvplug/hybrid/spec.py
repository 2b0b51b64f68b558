"""A hybrid model's state groups: what each kind of layer keeps, in bytes and in FLOPs.

A hybrid model mixes layers that keep different state per sequence:

- full attention keeps every token's K and V;
- sliding window keeps K and V too, but a position ``k`` needs only the tokens in the
  window before it;
- Mamba/SSM keeps one fixed-size state per sequence, valid only at the exact position it
  was taken (a *checkpoint*).

Layers are split into groups of equal layer count, as vLLM's hybrid allocator does: with
``n`` layers in the rarest kind, every kind's layers form groups of ``n`` (the last one
padded), so every group's page is the same size in an engine that pages all groups from
one pool. `HybridSpec` holds the groups and the prefill FLOPs model:

    flops(p) = linear + full_attention * p + window_attention * min(p, window)

where ``linear`` counts every layer's projections and MLP and the SSM's scan (linear in
the sequence), ``full_attention`` the QK^T and AV work of full-attention layers per earlier
token, and ``window_attention`` the same for sliding-window layers, which look back at
most ``window`` tokens.

A unit is ``block_tokens`` tokens (one replay block). Invariants: every group has at least
one layer; a sliding-window group has a window and no other group does; a Mamba group has
a positive checkpoint size and no per-token bytes; an attention group has no checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from kvplug.core.groups import GroupKind
from kvplug.core.model_spec import dtype_bytes, read_config_json
from kvplug.errors import ConfigError


@dataclass(frozen=True)
class StateGroup:
    """One group of `layers` layers of one kind; bytes count all its layers together."""

    kind: GroupKind
    layers: int
    bytes_per_token: int = 0  # attention groups: K and V of one token
    sliding_window: int | None = None  # sliding-window groups: the window, in tokens
    checkpoint_bytes: int = 0  # Mamba groups: one state checkpoint

    def __post_init__(self) -> None:
        if self.layers < 1:
            raise ConfigError(f"a state group needs >= 1 layer, got {self.layers}")
        if (self.kind is GroupKind.SLIDING_WINDOW) != (self.sliding_window is not None):
            raise ConfigError("sliding_window is required for, and only for, sliding window")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.kind is GroupKind.MAMBA:
            if self.checkpoint_bytes < 1 or self.bytes_per_token:
                raise ConfigError("a Mamba group has checkpoint_bytes > 0 and no per-token bytes")
        elif self.checkpoint_bytes or self.bytes_per_token < 1:
            raise ConfigError("an attention group has bytes_per_token > 0 and no checkpoint")

    def unit_bytes(self, block_tokens: int) -> int:
        """Bytes this group holds for one unit: a KV page, or one checkpoint."""
        if self.kind is GroupKind.MAMBA:
            return self.checkpoint_bytes
        return self.bytes_per_token * block_tokens

    def window_units(self, block_tokens: int) -> int:
        """Units a hit needs before its end: every unit for full attention, the units
        covering the ``window - 1`` tokens before it for sliding window (vLLM's rule), none
        besides the checkpoint itself for Mamba."""
        if self.kind is GroupKind.SLIDING_WINDOW:
            return -(-(self.sliding_window - 1) // block_tokens)
        return 0


@dataclass(frozen=True)
class HybridSpec:
    """A model as state groups plus its prefill FLOPs model (see the module docstring)."""

    name: str
    groups: tuple[StateGroup, ...]
    linear_flops_per_token: float
    full_attention_flops_per_position: float
    window_attention_flops_per_position: float = 0.0

    def __post_init__(self) -> None:
        if not self.groups:
            raise ConfigError(f"model {self.name!r} has no state groups")
        windows = {g.sliding_window for g in self.groups if g.sliding_window is not None}
        if len(windows) > 1:
            raise ConfigError(
                f"model {self.name!r}: one sliding window is supported, got {sorted(windows)}"
            )

    @property
    def window(self) -> int | None:
        """The sliding window in tokens, or None without sliding-window layers."""
        return next((g.sliding_window for g in self.groups if g.sliding_window), None)

    def kinds(self) -> set[GroupKind]:
        return {group.kind for group in self.groups}

    def kind_unit_bytes(self, kind: GroupKind, block_tokens: int) -> int:
        """Bytes all groups of `kind` hold for one unit together."""
        return sum(g.unit_bytes(block_tokens) for g in self.groups if g.kind is kind)

    def page_bytes(self, block_tokens: int) -> int:
        """The uniform page of an engine that pages every group from one pool (vLLM):
        the largest group's unit, the others padded to it."""
        return max(g.unit_bytes(block_tokens) for g in self.groups)

    def prefill_flops(self, start: int, end: int) -> float:
        """FLOPs to prefill positions ``[start, end)`` with the state at `start` cached."""
        n = end - start
        if n <= 0:
            return 0.0
        flops = self.linear_flops_per_token * n
        flops += self.full_attention_flops_per_position * (start + end - 1) * n / 2
        if self.window_attention_flops_per_position:
            window = self.window or 0
            # sum of min(p, window) for p in [start, end)
            below = max(0, min(end, window) - start)
            in_window = (start + start + below - 1) * below / 2 if below else 0.0
            flops += self.window_attention_flops_per_position * (in_window + window * (n - below))
        return flops

    def full_attention_equivalent(self) -> HybridSpec:
        """The same model with every attention and Mamba layer made full attention, with
        the KV size of this model's attention layers: the comparison the hybrid's state
        savings are measured against."""
        per_layer = next(
            (g.bytes_per_token // g.layers for g in self.groups if g.bytes_per_token), 0
        )
        layers = sum(g.layers for g in self.groups)
        attention_per_layer = _per_layer_attention(self)
        return HybridSpec(
            name=f"{self.name} (all full attention)",
            groups=(StateGroup(GroupKind.FULL, layers, bytes_per_token=per_layer * layers),),
            linear_flops_per_token=self.linear_flops_per_token,
            full_attention_flops_per_position=attention_per_layer * layers,
        )


def _per_layer_attention(spec: HybridSpec) -> float:
    full = sum(g.layers for g in spec.groups if g.kind is GroupKind.FULL)
    window = sum(g.layers for g in spec.groups if g.kind is GroupKind.SLIDING_WINDOW)
    if full:
        return spec.full_attention_flops_per_position / full
    return spec.window_attention_flops_per_position / window if window else 0.0


# ------------------------------------------------------------------ from a layer pattern

LAYER_KINDS = {
    "full_attention": GroupKind.FULL,
    "attention": GroupKind.FULL,
    "sliding_attention": GroupKind.SLIDING_WINDOW,
    "sliding_window": GroupKind.SLIDING_WINDOW,
    "mamba": GroupKind.MAMBA,
    "mamba2": GroupKind.MAMBA,
}


@dataclass(frozen=True)
class MambaShape:
    """A Mamba2 layer's state: ``heads * head_dim * state_size`` SSM values plus the conv
    window of ``(heads * head_dim + 2 * groups * state_size) * (conv_kernel - 1)``."""

    heads: int
    head_dim: int
    state_size: int
    groups: int = 1
    conv_kernel: int = 4

    def state_values(self) -> int:
        inner = self.heads * self.head_dim
        conv = (inner + 2 * self.groups * self.state_size) * (self.conv_kernel - 1)
        return inner * self.state_size + conv

    def scan_flops_per_token(self) -> float:
        # the selective scan updates and reads every state value once per token
        return 2.0 * 2 * self.heads * self.head_dim * self.state_size


def from_layers(
    name: str,
    layer_kinds: list[str],
    *,
    hidden_size: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    mlp_layers: int | None = None,
    sliding_window: int | None = None,
    mamba: MambaShape | None = None,
    dtype: str = "bfloat16",
) -> HybridSpec:
    """Build the groups from a per-layer pattern of kinds (the names in `LAYER_KINDS`).

    `mlp_layers` counts layers with an MLP (all layers when None; Nemotron-H has separate
    MLP-only layers, passed as ``mlp_layers`` with no entry in `layer_kinds`).
    """
    unknown = sorted({kind for kind in layer_kinds if kind not in LAYER_KINDS})
    if unknown:
        raise ConfigError(
            f"model {name!r}: kvplug cannot map layer types {unknown} to state groups; "
            f"it maps {', '.join(sorted(LAYER_KINDS))}"
        )
    counts: dict[GroupKind, int] = {}
    for kind in layer_kinds:
        counts[LAYER_KINDS[kind]] = counts.get(LAYER_KINDS[kind], 0) + 1
    if GroupKind.SLIDING_WINDOW in counts and not sliding_window:
        raise ConfigError(f"model {name!r} has sliding-window layers but no sliding_window")
    if GroupKind.MAMBA in counts and mamba is None:
        raise ConfigError(f"model {name!r} has Mamba layers but no Mamba state shape")
    value_bytes = dtype_bytes(dtype)
    kv_per_layer = int(2 * kv_heads * head_dim * value_bytes)
    group_size = min(counts.values())
    groups = []
    for kind, count in counts.items():
        for _ in range(math.ceil(count / group_size)):
            if kind is GroupKind.MAMBA:
                checkpoint = int(mamba.state_values() * value_bytes * group_size)
                groups.append(StateGroup(kind, group_size, checkpoint_bytes=checkpoint))
            else:
                window = sliding_window if kind is GroupKind.SLIDING_WINDOW else None
                groups.append(
                    StateGroup(kind, group_size, kv_per_layer * group_size, sliding_window=window)
                )
    q_dim, kv_dim = q_heads * head_dim, kv_heads * head_dim
    attention_layers = counts.get(GroupKind.FULL, 0) + counts.get(GroupKind.SLIDING_WINDOW, 0)
    projections = hidden_size * (q_dim + 2 * kv_dim) + q_dim * hidden_size
    linear = 2.0 * attention_layers * projections
    linear += (
        2.0
        * (len(layer_kinds) if mlp_layers is None else mlp_layers)
        * (3 * hidden_size * intermediate_size)
    )
    if mamba is not None:
        inner = mamba.heads * mamba.head_dim
        in_out = hidden_size * (2 * inner + 2 * mamba.groups * mamba.state_size + mamba.heads)
        in_out += inner * hidden_size
        linear += counts.get(GroupKind.MAMBA, 0) * (2.0 * in_out + mamba.scan_flops_per_token())
    per_layer_attention = 4.0 * q_heads * head_dim
    return HybridSpec(
        name=name,
        groups=tuple(groups),
        linear_flops_per_token=linear,
        full_attention_flops_per_position=per_layer_attention * counts.get(GroupKind.FULL, 0),
        window_attention_flops_per_position=per_layer_attention
        * counts.get(GroupKind.SLIDING_WINDOW, 0),
    )


def _gemma3_like() -> HybridSpec:
    # Gemma 3 12B: 48 layers, five sliding-window (1024 tokens) to one full attention.
    kinds = (["sliding_attention"] * 5 + ["full_attention"]) * 8
    return from_layers(
        "gemma3-like",
        kinds,
        hidden_size=3840,
        q_heads=16,
        kv_heads=8,
        head_dim=256,
        intermediate_size=15360,
        sliding_window=1024,
    )


def _nemotron_h_like() -> HybridSpec:
    # Nemotron-H 8B: 52 layers, 24 Mamba2 + 4 attention + 24 MLP-only.
    kinds = ["mamba"] * 24 + ["attention"] * 4
    return from_layers(
        "nemotron-h-like",
        kinds,
        hidden_size=4096,
        q_heads=32,
        kv_heads=8,
        head_dim=128,
        intermediate_size=21504,
        mlp_layers=24,
        mamba=MambaShape(heads=128, head_dim=64, state_size=128, groups=8),
    )


HYBRID_PRESETS = {spec.name: spec for spec in (_gemma3_like(), _nemotron_h_like())}


def hybrid_from_hf_config(config: dict, name: str = "model") -> HybridSpec:
    """A hybrid spec from a Hugging Face ``config.json``.

    Read: ``layer_types`` (Gemma 3, Qwen3-Next style), ``hybrid_override_pattern``
    (Nemotron-H: ``M`` Mamba, ``*`` attention, ``-`` MLP only) or ``layers_block_type``
    (Jamba style). A config with none of them is all full attention. Layer types kvplug
    cannot map raise `ConfigError` naming them.
    """
    cfg = config.get("text_config") or config
    try:
        hidden = int(cfg["hidden_size"])
        q_heads = int(cfg["num_attention_heads"])
        layers = int(cfg["num_hidden_layers"])
    except KeyError as exc:
        raise ConfigError(
            f"model config {name!r} lacks {exc.args[0]!r}; needed: hidden_size, "
            "num_attention_heads, num_hidden_layers"
        ) from None
    mlp_layers = None
    if "hybrid_override_pattern" in cfg:
        symbols = {"M": "mamba", "*": "attention", "-": None, "E": None}
        pattern = str(cfg["hybrid_override_pattern"])
        bad = sorted({s for s in pattern if s not in symbols})
        if bad:
            raise ConfigError(
                f"model {name!r}: hybrid_override_pattern has layer symbols {bad}; kvplug "
                "maps M (Mamba), * (attention), - and E (MLP / MoE only)"
            )
        kinds = [symbols[s] for s in pattern if symbols[s]]
        mlp_layers = sum(1 for s in pattern if s in "-E")
    elif "layer_types" in cfg:
        kinds = [str(kind) for kind in cfg["layer_types"]]
    elif "layers_block_type" in cfg:
        kinds = [str(kind) for kind in cfg["layers_block_type"]]
    else:
        kinds = ["full_attention"] * layers
    mamba = None
    if any(LAYER_KINDS.get(kind) is GroupKind.MAMBA for kind in kinds):
        heads = int(cfg.get("mamba_num_heads") or cfg.get("mamba_n_heads") or 1)
        mamba = MambaShape(
            heads=heads,
            head_dim=int(cfg.get("mamba_head_dim") or cfg.get("mamba_d_head") or 64),
            state_size=int(cfg.get("ssm_state_size") or cfg.get("mamba_d_state") or 128),
            groups=int(cfg.get("n_groups") or cfg.get("mamba_n_groups") or 1),
            conv_kernel=int(cfg.get("conv_kernel") or cfg.get("mamba_d_conv") or 4),
        )
    return from_layers(
        cfg.get("_name_or_path") or name,
        kinds,
        hidden_size=hidden,
        q_heads=q_heads,
        kv_heads=int(cfg.get("num_key_value_heads") or q_heads),
        head_dim=int(cfg.get("head_dim") or hidden // q_heads),
        intermediate_size=int(cfg.get("intermediate_size") or 4 * hidden),
        mlp_layers=mlp_layers,
        sliding_window=cfg.get("sliding_window"),
        mamba=mamba,
        dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
    )


def load_hybrid(source: str | Path) -> HybridSpec:
    """A hybrid preset name, a ``config.json`` path, or a directory holding one."""
    if str(source) in HYBRID_PRESETS:
        return HYBRID_PRESETS[str(source)]
    data, name = read_config_json(source, "hybrid model", list(HYBRID_PRESETS))
    return hybrid_from_hf_config(data, name=name)


__all__ = [
    "HYBRID_PRESETS",
    "HybridSpec",
    "MambaShape",
    "StateGroup",
    "from_layers",
    "hybrid_from_hf_config",
    "load_hybrid",
]
