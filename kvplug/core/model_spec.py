"""What cached KV is worth: prefill FLOPs per position, KV bytes per token, the KV budget.

`ModelSpec` holds the handful of numbers that decide both, read from a Hugging Face
``config.json`` or a named preset. Prefill cost of the token at position ``p`` (0-based):

    flops(p) = linear + attention * p
    linear    = 2 * layers * (hidden * (q_dim + 2 * kv_dim) + q_dim * hidden + 3 * hidden * inter)
    attention = 4 * layers * q_heads * head_dim      (QK^T and AV over the p earlier tokens)

so a cached prefix saves more per token the deeper it sits. KV bytes per token are
``2 * layers * kv_heads * head_dim * bytes_per_value``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from kvplug.errors import ConfigError

DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
    "int4": 0.5,
}


def dtype_bytes(dtype: str) -> float:
    key = dtype.lower().removeprefix("torch.")
    if key not in DTYPE_BYTES:
        raise ConfigError(f"unknown dtype {dtype!r}; accepted: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[key]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    hidden_size: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int = 32000
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for field in ("layers", "hidden_size", "q_heads", "kv_heads", "head_dim"):
            if getattr(self, field) < 1:
                raise ConfigError(f"model {self.name!r}: {field} must be >= 1")
        if self.q_heads % self.kv_heads:
            raise ConfigError(
                f"model {self.name!r}: q_heads {self.q_heads} is not a multiple of kv_heads "
                f"{self.kv_heads}"
            )
        dtype_bytes(self.dtype)

    @cached_property  # read for every prefill estimate; the fields never change
    def linear_flops_per_token(self) -> float:
        q_dim, kv_dim = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        h = self.hidden_size
        per_layer = h * (q_dim + 2 * kv_dim) + q_dim * h + 3 * h * self.intermediate_size
        return 2.0 * self.layers * per_layer

    @cached_property
    def attention_flops_per_position(self) -> float:
        return 4.0 * self.layers * self.q_heads * self.head_dim

    def prefill_flops(self, start: int, end: int) -> float:
        """FLOPs to prefill positions ``[start, end)`` with positions before `start` cached."""
        n = end - start
        if n <= 0:
            return 0.0
        return self.linear_flops_per_token * n + self.attention_flops_per_position * (
            (start + end - 1) * n / 2
        )

    def kv_bytes_per_token(self, kv_dtype: str | None = None, tp: int = 1) -> float:
        """KV bytes one token occupies on one of `tp` ranks (KV heads split, or replicated
        when there are fewer heads than ranks)."""
        heads = max(1, math.ceil(self.kv_heads / tp))
        return 2 * self.layers * heads * self.head_dim * dtype_bytes(kv_dtype or self.dtype)

    def weight_bytes(self, weight_dtype: str | None = None) -> float:
        """Approximate weight memory: attention, MLP, embeddings and LM head."""
        q_dim, kv_dim = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        h = self.hidden_size
        per_layer = h * (q_dim + 2 * kv_dim) + q_dim * h + 3 * h * self.intermediate_size
        params = self.layers * per_layer + 2 * self.vocab_size * h
        return params * dtype_bytes(weight_dtype or self.dtype)

    @classmethod
    def from_hf_config(cls, config: dict, name: str = "model") -> ModelSpec:
        """Read a Hugging Face ``config.json`` (text models; `text_config` is followed)."""
        cfg = config.get("text_config") or config
        try:
            hidden = int(cfg["hidden_size"])
            q_heads = int(cfg["num_attention_heads"])
            return cls(
                name=cfg.get("_name_or_path") or name,
                layers=int(cfg["num_hidden_layers"]),
                hidden_size=hidden,
                q_heads=q_heads,
                kv_heads=int(cfg.get("num_key_value_heads") or q_heads),
                head_dim=int(cfg.get("head_dim") or hidden // q_heads),
                intermediate_size=int(cfg.get("intermediate_size") or 4 * hidden),
                vocab_size=int(cfg.get("vocab_size") or 32000),
                dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
            )
        except KeyError as exc:
            raise ConfigError(
                f"model config {name!r} lacks {exc.args[0]!r}; needed: hidden_size, "
                "num_attention_heads, num_hidden_layers (and optionally num_key_value_heads, "
                "head_dim, intermediate_size, vocab_size, torch_dtype)"
            ) from None

    def as_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256),
        ModelSpec("llama-3.1-70b", 80, 8192, 64, 8, 128, 28672, 128256),
        ModelSpec("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064),
        ModelSpec("qwen2.5-72b", 80, 8192, 64, 8, 128, 29568, 152064),
        ModelSpec("mistral-7b", 32, 4096, 32, 8, 128, 14336, 32768),
    )
}
DEFAULT_MODEL = "llama-3.1-8b"


def served_model(model_config: Any, name: str) -> ModelSpec:
    """The shape of the model an engine serves, from its config object's
    ``hf_text_config`` (vLLM's and SGLang's model configs both have one); the default
    preset if that cannot be read, since FLOPs estimates then only rank blocks."""
    try:
        return ModelSpec.from_hf_config(model_config.hf_text_config.to_dict(), name=name)
    except Exception:  # an architecture kvplug cannot read
        return load_model(None)


def load_model(source: str | Path | None) -> ModelSpec:
    """A preset name, a ``config.json`` path, or a directory holding one."""
    if source is None:
        return PRESETS[DEFAULT_MODEL]
    if str(source) in PRESETS:
        return PRESETS[str(source)]
    data, name = read_config_json(source, "model", list(PRESETS))
    return ModelSpec.from_hf_config(data, name=name)


def read_config_json(source: str | Path, what: str, presets: list[str]) -> tuple[dict, str]:
    """A Hugging Face ``config.json`` (`source` is the file or its directory) and the name
    to give the model; `what` and `presets` name the alternatives in the error."""
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"{what} {str(source)!r} is neither a preset ({', '.join(presets)}) nor a "
            "config.json file or a directory holding one"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from None
    return data, path.parent.name or str(path)


# ---------------------------------------------------------------- the budget worksheet

GIB = 1024**3


@dataclass(frozen=True)
class Budget:
    model: str
    tp: int
    weights_per_rank_gib: float
    kv_memory_per_rank_gib: float
    kv_bytes_per_token_per_rank: float
    max_kv_tokens: int
    max_sequences: dict[int, int]  # context length -> concurrent sequences that fit
    recommended_max_num_seqs: dict[int, int]  # at `utilization` of the KV memory
    utilization: float


def kv_budget(
    model: ModelSpec,
    gpu_memory_gib: float,
    *,
    tp: int = 1,
    weight_dtype: str | None = None,
    kv_dtype: str | None = None,
    overhead_gib: float = 0.0,
    context_lengths: tuple[int, ...] = (4096, 32768),
    weights_gib: float | None = None,
    utilization: float = 0.85,
) -> Budget:
    """How many KV tokens and sequences fit on each of `tp` ranks.

    `weights_gib` is the whole model's weight memory; computed from the config if None.
    """
    if tp < 1 or gpu_memory_gib <= 0 or not 0 < utilization <= 1:
        raise ConfigError("tp must be >= 1, gpu memory > 0 and utilization in (0, 1]")
    total_weights = (
        weights_gib * GIB if weights_gib is not None else model.weight_bytes(weight_dtype)
    )
    weights = total_weights / tp
    kv_memory = gpu_memory_gib * GIB - weights - overhead_gib * GIB
    if kv_memory <= 0:
        raise ConfigError(
            f"no memory left for KV: {gpu_memory_gib} GiB per rank - {weights / GIB:.1f} GiB "
            f"weights - {overhead_gib} GiB overhead <= 0"
        )
    per_token = model.kv_bytes_per_token(kv_dtype, tp)
    max_tokens = kv_memory / per_token
    return Budget(
        model=model.name,
        tp=tp,
        weights_per_rank_gib=weights / GIB,
        kv_memory_per_rank_gib=kv_memory / GIB,
        kv_bytes_per_token_per_rank=per_token,
        max_kv_tokens=int(max_tokens),
        max_sequences={c: int(max_tokens // c) for c in context_lengths},
        recommended_max_num_seqs={c: int(max_tokens * utilization // c) for c in context_lengths},
        utilization=utilization,
    )
