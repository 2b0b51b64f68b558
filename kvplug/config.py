"""One validated kvplug configuration, loaded from a dict, JSON, YAML or a file.

`KVPlugConfig.load` is the single entry point engines use. Every problem is raised as a
`ConfigError` whose message names the full dotted key and what is accepted; when a
source has several problems, one error lists them all. Values are checked strictly
(``"16"`` is not an integer, ``1`` is not a boolean), and the eviction policy is built
once at load time so that a bad ``policy_config`` is reported before the engine starts.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from kvplug import policies
from kvplug.core.keys import DEFAULT_HASH, HASH_ALGORITHMS
from kvplug.core.queue_protection import MAX_DEPTH
from kvplug.core.retention import RetentionBook
from kvplug.errors import ConfigError, UnknownPolicyError

if TYPE_CHECKING:
    from kvplug.core.model_spec import ModelSpec
    from kvplug.policies.base import EvictionPolicy

ENV_VAR = "KVPLUG_CONFIG"
WRAPPER_KEY = "kvplug"  # engines pass additional_config={"kvplug": {...}}
FILE_SUFFIXES = (".yaml", ".yml", ".json")
_PREFIX = "kvplug config: "


class NamespaceConfig(BaseModel):
    """The parts of the cache namespace that come from configuration."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    model_revision: str = ""
    tenant: str = ""
    share_across_tenants: bool = False
    # Salt default-tenant requests' block hashes in the KV events too. Off by default: a
    # router that recomputes vLLM's hashes from the prompt (llm-d's precise prefix-cache
    # scorer) then finds them; state itself never leaves the engine through events.
    salt_kv_events: bool = False


class RetentionConfig(BaseModel):
    """What requests may ask the cache to keep after they end (``kvplug_retain_s``):
    each tenant's cap, as a fraction of the cache (`cap_fraction`, or `tenant_caps` per
    tenant), the longest time a request may ask for, and per-tenant defaults in seconds
    for requests that ask for nothing (``""`` is the default tenant)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    cap_fraction: float = Field(default=0.25, ge=0.0, le=1.0)
    tenant_caps: dict[str, Annotated[float, Field(ge=0.0, le=1.0)]] = Field(default_factory=dict)
    max_seconds: float = Field(default=3600.0, gt=0.0)
    default_seconds: dict[str, Annotated[float, Field(gt=0.0)]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _defaults_within_max(self) -> RetentionConfig:
        for tenant, seconds in self.default_seconds.items():
            if seconds > self.max_seconds:
                raise ValueError(
                    f"default_seconds[{tenant!r}] = {seconds:g} exceeds max_seconds "
                    f"{self.max_seconds:g}"
                )
        return self

    def book(self, num_blocks: int) -> RetentionBook:
        """The `RetentionBook` of a cache of `num_blocks` blocks under these settings."""
        caps = {tenant: int(f * num_blocks) for tenant, f in self.tenant_caps.items()}
        return RetentionBook(int(self.cap_fraction * num_blocks), caps, self.max_seconds)


class QueueProtectionConfig(BaseModel):
    """How many waiting requests claim the cached blocks they will hit, refreshed once per
    step (`kvplug.core.queue_protection`); 0: none."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    requests: int = Field(default=0, ge=0, le=MAX_DEPTH)


class KVPlugConfig(BaseModel):
    """The whole kvplug configuration. Every field has a default."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    policy: str = "cost"  # the cost-aware evictor; "lru" reproduces vLLM's stock order
    policy_config: dict[str, Any] = Field(default_factory=dict)
    block_size: int | None = Field(default=None, ge=1)  # None: the engine's choice
    hash_algo: str = DEFAULT_HASH
    enable_prefix_caching: bool = True
    namespace: NamespaceConfig = Field(default_factory=NamespaceConfig)
    strict_version: bool = True  # refuse an untested engine version unless False
    retention: RetentionConfig = Field(default_factory=RetentionConfig)
    queue_protection: QueueProtectionConfig = Field(default_factory=QueueProtectionConfig)

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, name: str) -> str:
        return _one_of(name, policies.available_policies())

    @field_validator("hash_algo")
    @classmethod
    def _known_hash(cls, name: str) -> str:
        return _one_of(name, sorted(HASH_ALGORITHMS))

    @model_validator(mode="after")
    def _policy_accepts_its_config(self) -> KVPlugConfig:
        try:  # offline policies are refused where a server builds one (`build_policy`)
            policies.make_policy(self.policy, self.policy_config)
        except Exception as exc:  # any failure to build the policy is a config problem
            raise ValueError(_policy_config_problem(self.policy, self.policy_config, exc)) from exc
        return self

    # -- loaders -------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> KVPlugConfig:
        """Validate a mapping; ``{"kvplug": {...}}`` is unwrapped and None means defaults."""
        return cls._from_data(data, origin=None)

    @classmethod
    def from_json(cls, text: str) -> KVPlugConfig:
        """Parse and validate a JSON object (``{"kvplug": {...}}`` is unwrapped)."""
        return cls._from_data(_parse_json(text, origin=None), origin=None)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> KVPlugConfig:
        """Read and validate a YAML file; an empty file means defaults."""
        text = _read(Path(path))
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(_PREFIX + f"invalid YAML in {path}{_yaml_where(exc)}") from exc
        return cls._from_data(data, origin=str(path))

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> KVPlugConfig:
        """Read a .yaml, .yml or .json file, chosen by its suffix."""
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix in (".yaml", ".yml"):
            return cls.from_yaml(path)
        if suffix == ".json":
            return cls._from_data(_parse_json(_read(path), origin=str(path)), origin=str(path))
        raise ConfigError(
            _PREFIX + f"cannot read {str(path)!r}: unsupported file type {suffix or '(none)'!r}"
            f" (accepted: {', '.join(FILE_SUFFIXES)})"
        )

    @classmethod
    def load(cls, source: Any = None) -> KVPlugConfig:
        """Build a config from whatever an engine or user hands over.

        Accepts None (the file named by ``$KVPLUG_CONFIG`` if set and non-empty, else
        defaults), a `KVPlugConfig` (returned as is), a mapping, a JSON string, or
        a path (str or Path) to a .yaml/.yml/.json file.
        """
        if source is None:
            env_path = os.environ.get(ENV_VAR, "").strip()
            if not env_path:
                return cls()
            try:
                return cls.from_file(env_path)
            except ConfigError as exc:
                raise ConfigError(f"{exc} (file named by ${ENV_VAR})") from exc
        if isinstance(source, KVPlugConfig):
            return source
        if isinstance(source, Mapping):
            return cls.from_dict(source)
        if isinstance(source, str) and source.lstrip()[:1] in ("{", "["):
            return cls.from_json(source)
        if isinstance(source, str | os.PathLike):
            if not str(source).strip():
                raise ConfigError(_PREFIX + "empty path given as the config source")
            return cls.from_file(source)
        raise ConfigError(
            _PREFIX + f"cannot load a config from {type(source).__name__}; accepted: None, "
            "a mapping, a JSON string, a KVPlugConfig, or a path to a "
            + "/".join(FILE_SUFFIXES)
            + " file"
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain data that `from_dict` turns back into an equal config."""
        return self.model_dump()

    def with_policy(self, policy: str | None) -> KVPlugConfig:
        """This config serving `policy` instead (None: its own); another policy's
        parameters do not carry over."""
        if policy is None or policy == self.policy:
            return self
        return KVPlugConfig.load({**self.to_dict(), "policy": policy, "policy_config": {}})

    @classmethod
    def _from_data(cls, data: Any, origin: str | None) -> KVPlugConfig:
        where = f" in {origin}" if origin else ""
        what = "the top level"
        if isinstance(data, Mapping) and len(data) == 1 and WRAPPER_KEY in data:
            data, what = data[WRAPPER_KEY], repr(WRAPPER_KEY)
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(
                _PREFIX + f"{what}{where} must be a mapping of keys to values "
                f"(optionally under a single {WRAPPER_KEY!r} key), not {type(data).__name__}"
            )
        try:
            return cls.model_validate(dict(data))
        except ValidationError as exc:
            problems = [_describe(err) for err in exc.errors()]
            raise ConfigError(_join(problems, where)) from None


def build_policy(config: KVPlugConfig, model: ModelSpec) -> EvictionPolicy:
    """The policy an engine adapter serves with: `config`'s policy and parameters, valuing
    blocks with the served `model` unless the config names one. Offline-only policies
    are refused, naming those a server accepts."""
    context = policies.PolicyContext(model=model, serving=True)
    try:
        return policies.make_policy(config.policy, config.policy_config, context)
    except UnknownPolicyError as exc:
        raise ConfigError(f"kvplug config: {exc}") from None


# -- messages --------------------------------------------------------------------------


def _one_of(value: str, accepted: list[str]) -> str:
    if value not in accepted:
        raise ValueError(f"must be one of: {', '.join(accepted)}{_did_you_mean(value, accepted)}")
    return value


def _did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(str(word), choices, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _join(problems: list[str], where: str) -> str:
    if len(problems) == 1:
        return _PREFIX + problems[0] + (f" ({where.strip()})" if where else "")
    lines = "".join(f"\n  - {p}" for p in problems)
    return _PREFIX + f"{len(problems)} problems{where}:{lines}"


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _model_at(path: tuple[str, ...]) -> type[BaseModel]:
    """The model class that holds the keys found at dotted `path` below the top level."""
    model: type[BaseModel] = KVPlugConfig
    for part in path:
        field = model.model_fields.get(part)
        if field is None or not (
            isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
        ):
            break
        model = field.annotation
    return model


def _unknown_key(loc: tuple[str, ...]) -> str:
    accepted = sorted(_model_at(loc[:-1]).model_fields)
    under = f" under {'.'.join(loc[:-1])!r}" if len(loc) > 1 else ""
    return (
        f"unknown key {'.'.join(loc)!r} (accepted keys{under}: {', '.join(accepted)})"
        + _did_you_mean(loc[-1], accepted)
    )


_REASONS = {
    "int_type": "must be an integer",
    "bool_type": "must be true or false",
    "string_type": "must be a string",
    "dict_type": "must be a mapping",
    "invalid_key": "keys must be strings",
}


def _describe(err: ErrorDetails) -> str:
    loc = tuple(str(part) for part in err["loc"])
    kind = err["type"]
    ctx = err.get("ctx", {})
    if kind == "extra_forbidden" or (kind == "invalid_key" and len(loc) == 1):
        return _unknown_key(loc)
    if kind == "value_error" and not loc:  # raised by a model validator, already worded
        return str(ctx["error"])
    if kind == "value_error":
        reason = str(ctx["error"])
    elif kind == "greater_than_equal":
        reason = f"must be >= {ctx['ge']}"
    elif kind in ("model_type", "model_attributes_type"):
        keys = ", ".join(sorted(_model_at(loc).model_fields))
        reason = f"must be a mapping with keys: {keys}"
    else:
        msg = err["msg"]
        reason = _REASONS.get(kind, msg[:1].lower() + msg[1:])
    return f"{'.'.join(loc)!r} = {_show(err['input'])} is not accepted: {reason}"


def _policy_config_problem(policy: str, config: dict[str, Any], exc: Exception) -> str:
    try:
        accepted = policies.policy_parameters(policy)
    except Exception:  # best effort: only used to improve a message
        accepted = None
    unexpected = [key for key in config if accepted is not None and key not in accepted]
    if unexpected and accepted is not None:
        key = unexpected[0]
        listing = (
            ", ".join(accepted) if accepted else f"none: policy {policy!r} takes no parameters"
        )
        return (
            f"unknown key {'policy_config.' + key!r} for policy {policy!r} "
            f"(accepted keys under 'policy_config': {listing})" + _did_you_mean(key, accepted)
        )
    hint = f" (accepted keys: {', '.join(accepted) or 'none'})" if accepted is not None else ""
    return f"'policy_config' = {_show(config)} is not accepted by policy {policy!r}: {exc}{hint}"


# -- reading ---------------------------------------------------------------------------


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(_PREFIX + f"config file not found: {str(path)!r}") from None
    except IsADirectoryError:
        raise ConfigError(
            _PREFIX + f"config path is a directory, not a file: {str(path)!r}"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(_PREFIX + f"cannot read config file {str(path)!r}: {exc}") from None


def _parse_json(text: str, origin: str | None) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        where = f" in {origin}" if origin else ""
        raise ConfigError(
            _PREFIX + f"invalid JSON{where} at line {exc.lineno}, column {exc.colno}: {exc.msg}"
        ) from None


def _yaml_where(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        return f" at line {mark.line + 1}, column {mark.column + 1}: {exc.problem}"
    return f": {exc}"


__all__ = ["ENV_VAR", "KVPlugConfig", "NamespaceConfig", "build_policy"]
