"""Namespaced, chained block keys.

A block's key is ``H(parent_key, token_ids, extras)`` where the first block's parent
is the *root key* of its namespace, ``H(namespace)``. So a key names the whole prefix up
to and including its block, under one namespace: the same tokens under another model
revision, tokenizer, adapter, tenant, position scheme, layout, dtype or block size give
another key, and so does the same placeholder token under another image.

Keys name; they do not prove. The prefix index stores each block's token ids and
extras and compares them on every match, and keeps one tree per `Namespace` value
(compared by equality), so a hash collision is a miss, never wrong state.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import astuple, dataclass, replace

import xxhash

from kvplug.errors import ConfigError

BlockKey = bytes

HASH_ALGORITHMS: dict[str, Callable[[bytes], bytes]] = {
    "xxh3_128": lambda data: xxhash.xxh3_128_digest(data),
    "sha256": lambda data: hashlib.sha256(data).digest(),
    "blake2b": lambda data: hashlib.blake2b(data, digest_size=32).digest(),
}
DEFAULT_HASH = "xxh3_128"


@dataclass(frozen=True)
class Namespace:
    """Everything besides the token ids that decides whether cached KV may be reused.

    Two requests may share a block only if their namespaces are equal. `tenant` holds a
    tenant id or a per-request cache salt; set it to "" (and configure
    ``share_across_tenants``) to let tenants share.
    """

    model: str = ""
    revision: str = ""
    tokenizer: str = ""
    adapter: str = ""  # LoRA adapter id; "" for the base model
    tenant: str = ""  # tenant id or cache salt
    position_scheme: str = "rope"
    layout: str = "NHD"  # cache layout, e.g. NHD or HND
    kv_dtype: str = "auto"
    block_size: int = 0  # tokens per block; 0 until a cache binds it

    def encode(self) -> bytes:
        """Unambiguous bytes: different namespaces never encode alike."""
        return encode_fields(str(field) for field in astuple(self))

    def with_block_size(self, block_size: int) -> Namespace:
        return self if self.block_size == block_size else replace(self, block_size=block_size)


@dataclass(frozen=True)
class MMFeature:
    """A multimodal input (an image, an audio clip) occupying prompt positions
    ``[offset, offset + length)``. `digest` identifies its content."""

    digest: str
    offset: int
    length: int

    def overlaps(self, start: int, end: int) -> bool:
        return self.offset < end and start < self.offset + self.length


class BlockHasher:
    """Computes chained block keys with one of `HASH_ALGORITHMS`."""

    def __init__(self, algorithm: str = DEFAULT_HASH) -> None:
        if algorithm not in HASH_ALGORITHMS:
            raise ConfigError(
                f"unknown hash algorithm {algorithm!r}; accepted: {', '.join(HASH_ALGORITHMS)}"
            )
        self.algorithm = algorithm
        self._digest = HASH_ALGORITHMS[algorithm]

    def root_key(self, namespace: Namespace) -> BlockKey:
        return self._digest(b"kvplug-root\x00" + namespace.encode())

    def block_key(
        self, parent: BlockKey, tokens: Sequence[int], extras: tuple[str, ...] = ()
    ) -> BlockKey:
        payload = parent + array("q", tokens).tobytes()
        if extras:
            payload += b"\x00" + encode_fields(extras)
        return self._digest(payload)


def encode_fields(fields: Iterable[str]) -> bytes:
    """Each field as its UTF-8 length (4 bytes) then its bytes: no two different lists of
    fields give the same bytes, whatever characters the fields contain."""
    out = bytearray()
    for field in fields:
        data = field.encode()
        out += len(data).to_bytes(4, "little") + data
    return bytes(out)


def block_extras(features: Sequence[MMFeature], start: int, end: int) -> tuple[str, ...]:
    """The extras of the block covering token positions ``[start, end)``: the digest and
    relative offset of every multimodal feature that overlaps it."""
    return tuple(f"{f.digest}@{f.offset - start}" for f in features if f.overlaps(start, end))


def namespace_salt(parts: Sequence[str]) -> str:
    """The salt an engine adapter folds into a request's prefix keys: one digest of the
    namespace `parts` (model, revision, tokenizer, tenant, the request's own salt, in a
    fixed order), so requests that differ in any part share no cached state."""
    return "kvplug:" + xxhash.xxh3_128_hexdigest(encode_fields(parts))
