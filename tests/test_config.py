"""KVPlugConfig: defaults, every loader, and the wording of every error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvplug.config import ENV_VAR, KVPlugConfig, NamespaceConfig
from kvplug.core.keys import DEFAULT_HASH, HASH_ALGORITHMS
from kvplug.errors import ConfigError
from kvplug.policies import available_policies

TOP_KEYS = (
    "block_size, enable_prefix_caching, hash_algo, namespace, policy, policy_config, "
    "queue_protection, retention, strict_version"
)


def config_error(source: object) -> str:
    with pytest.raises(ConfigError) as info:
        KVPlugConfig.load(source)
    message = str(info.value)
    assert message.startswith("kvplug config: ")
    return message


def test_defaults() -> None:
    config = KVPlugConfig()
    assert config.policy == "cost"
    assert config.policy_config == {}
    assert config.block_size is None
    assert config.hash_algo == DEFAULT_HASH
    assert config.enable_prefix_caching is True
    assert config.namespace == NamespaceConfig()
    assert config.namespace.model_revision == ""
    assert config.namespace.tenant == ""
    assert config.namespace.share_across_tenants is False
    assert config.strict_version is True


FULL = {
    "policy": "lru",
    "policy_config": {},
    "block_size": 16,
    "hash_algo": "sha256",
    "enable_prefix_caching": False,
    "namespace": {
        "model_revision": "abc123",
        "tenant": "acme",
        "share_across_tenants": True,
        "salt_kv_events": True,
    },
    "strict_version": False,
    "retention": {
        "cap_fraction": 0.5,
        "tenant_caps": {"acme": 0.1},
        "max_seconds": 600.0,
        "default_seconds": {"": 30.0},
    },
    "queue_protection": {"requests": 16},
}


def test_retention_settings_give_each_tenant_its_cap_and_refuse_a_default_past_the_max() -> None:
    book = KVPlugConfig.from_dict(FULL).retention.book(1000)
    assert (book.cap_of("acme"), book.cap_of("other"), book.max_seconds) == (100, 500, 600.0)
    with pytest.raises(ConfigError, match=r"default_seconds\['t'\] = 700 exceeds max_seconds 600"):
        KVPlugConfig.from_dict(
            {"retention": {"max_seconds": 600.0, "default_seconds": {"t": 700.0}}}
        )
    with pytest.raises(ConfigError, match=r"'retention.cap_fraction' = 1.5 is not accepted"):
        KVPlugConfig.from_dict({"retention": {"cap_fraction": 1.5}})


def test_queue_protection_reads_at_most_the_bounded_number_of_waiting_requests() -> None:
    assert KVPlugConfig.from_dict({}).queue_protection.requests == 0
    assert (
        KVPlugConfig.from_dict({"queue_protection": {"requests": 8}}).queue_protection.requests == 8
    )
    with pytest.raises(ConfigError, match=r"'queue_protection.requests' = 1000 is not accepted"):
        KVPlugConfig.from_dict({"queue_protection": {"requests": 1000}})
    with pytest.raises(ConfigError, match=r"unknown key 'queue_protection.request'"):
        KVPlugConfig.from_dict({"queue_protection": {"request": 8}})


def test_from_dict_and_round_trip() -> None:
    config = KVPlugConfig.from_dict(FULL)
    assert config.block_size == 16
    assert config.hash_algo == "sha256"
    assert config.namespace.tenant == "acme"
    assert config.to_dict() == FULL
    assert KVPlugConfig.from_dict(config.to_dict()) == config
    assert KVPlugConfig.from_json(json.dumps(config.to_dict())) == config


def test_from_json() -> None:
    config = KVPlugConfig.from_json('{"block_size": 32, "namespace": {"tenant": "t"}}')
    assert config.block_size == 32
    assert config.namespace.tenant == "t"


def test_from_yaml(tmp_path: Path) -> None:
    path = tmp_path / "kvplug.yaml"
    path.write_text("block_size: 8\nhash_algo: blake2b\nnamespace:\n  tenant: acme\n")
    config = KVPlugConfig.from_yaml(path)
    assert (config.block_size, config.hash_algo, config.namespace.tenant) == (8, "blake2b", "acme")


def test_empty_yaml_means_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yml"
    path.write_text("")
    assert KVPlugConfig.load(path) == KVPlugConfig()


@pytest.mark.parametrize("wrapped", [True, False])
def test_load_every_source_kind(tmp_path: Path, wrapped: bool) -> None:
    body = {"block_size": 64, "policy": "lru"}
    data = {"kvplug": body} if wrapped else body
    expected = KVPlugConfig(block_size=64, policy="lru")
    yaml_path = tmp_path / "c.yaml"
    yaml_path.write_text(("kvplug:\n" if wrapped else "") + "  block_size: 64\n  policy: lru\n")
    json_path = tmp_path / "c.json"
    json_path.write_text(json.dumps(data))

    assert KVPlugConfig.load(data) == expected
    assert KVPlugConfig.load(json.dumps(data)) == expected
    assert KVPlugConfig.load(yaml_path) == expected
    assert KVPlugConfig.load(str(yaml_path)) == expected
    assert KVPlugConfig.load(json_path) == expected
    assert KVPlugConfig.from_dict(data) == expected


def test_load_passes_a_config_through() -> None:
    config = KVPlugConfig(block_size=4)
    assert KVPlugConfig.load(config) is config


def test_load_none_uses_env_var(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert KVPlugConfig.load() == KVPlugConfig()

    path = tmp_path / "env.yaml"
    path.write_text("kvplug:\n  block_size: 128\n")
    monkeypatch.setenv(ENV_VAR, str(path))
    assert KVPlugConfig.load().block_size == 128
    assert KVPlugConfig.load(None).block_size == 128

    monkeypatch.setenv(ENV_VAR, "")
    assert KVPlugConfig.load() == KVPlugConfig()


def test_env_var_naming_a_missing_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "nope.yaml"
    monkeypatch.setenv(ENV_VAR, str(missing))
    message = config_error(None)
    assert "not found" in message
    assert str(missing) in message
    assert ENV_VAR in message


def test_unknown_key_suggests_the_close_one() -> None:
    message = config_error({"polcy": "lru"})
    assert "unknown key 'polcy'" in message
    assert f"accepted keys: {TOP_KEYS}" in message
    assert "did you mean 'policy'?" in message


def test_unknown_key_without_close_match() -> None:
    message = config_error({"zzzzzz": 1})
    assert "unknown key 'zzzzzz'" in message
    assert "did you mean" not in message


def test_unknown_nested_key_names_the_dotted_path() -> None:
    message = config_error({"namespace": {"tenat": "a"}})
    assert "unknown key 'namespace.tenat'" in message
    assert "model_revision, salt_kv_events, share_across_tenants, tenant" in message
    assert "did you mean 'tenant'?" in message


def test_block_size_must_be_positive() -> None:
    message = config_error({"block_size": 0})
    assert message == "kvplug config: 'block_size' = 0 is not accepted: must be >= 1"


@pytest.mark.parametrize(
    ("data", "key", "reason"),
    [
        ({"block_size": "16"}, "'block_size' = '16'", "must be an integer"),
        ({"block_size": True}, "'block_size' = True", "must be an integer"),
        ({"enable_prefix_caching": 1}, "'enable_prefix_caching' = 1", "must be true or false"),
        ({"namespace": {"tenant": 5}}, "'namespace.tenant' = 5", "must be a string"),
        ({"namespace": "acme"}, "'namespace' = 'acme'", "must be a mapping with keys:"),
        ({"policy_config": [1]}, "'policy_config' = [1]", "must be a mapping"),
    ],
)
def test_wrong_types_are_named(data: dict, key: str, reason: str) -> None:
    message = config_error(data)
    assert f"{key} is not accepted: {reason}" in message


def test_unknown_policy_lists_known_ones() -> None:
    message = config_error({"policy": "no-such-policy"})
    assert "'policy' = 'no-such-policy' is not accepted" in message
    assert f"must be one of: {', '.join(available_policies())}" in message


def test_policy_typo_suggests() -> None:
    assert "did you mean 'lru'?" in config_error({"policy": "lr"})


def test_unknown_hash_lists_accepted() -> None:
    message = config_error({"hash_algo": "md5"})
    assert "'hash_algo' = 'md5' is not accepted" in message
    for name in HASH_ALGORITHMS:
        assert name in message


def test_bad_policy_parameter_is_reported_at_load_time() -> None:
    message = config_error({"policy": "lru", "policy_config": {"capacity": 3}})
    assert "'policy_config.capacity'" in message
    assert "'lru'" in message


def test_several_problems_in_one_message() -> None:
    message = config_error({"polcy": "lru", "block_size": -1, "namespace": {"tenat": ""}})
    assert message.startswith("kvplug config: 3 problems")
    assert "'polcy'" in message
    assert "'block_size' = -1" in message
    assert "'namespace.tenat'" in message


def test_invalid_json_says_where() -> None:
    message = config_error('{"block_size": 16,\n "policy": }')
    assert "invalid JSON" in message
    assert "line 2, column" in message


def test_invalid_json_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("{")
    message = config_error(path)
    assert "invalid JSON" in message
    assert str(path) in message


def test_invalid_yaml_says_where(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("block_size: 16\npolicy: [lru\n")
    message = config_error(path)
    assert "invalid YAML" in message
    assert str(path) in message
    assert "line " in message


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yaml"
    message = config_error(missing)
    assert "not found" in message
    assert str(missing) in message


def test_unsupported_file_type(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text("block_size = 16\n")
    message = config_error(path)
    assert "'.toml'" in message
    assert ".yaml, .yml, .json" in message


@pytest.mark.parametrize("top", [[1, 2], "just a string", 3])
def test_top_level_must_be_a_mapping(tmp_path: Path, top: object) -> None:
    path = tmp_path / "list.yaml"
    path.write_text(json.dumps(top))  # JSON is YAML
    message = config_error(path)
    assert "must be a mapping" in message
    assert type(top).__name__ in message
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        KVPlugConfig.from_json(json.dumps(top))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        KVPlugConfig.from_dict(top)  # type: ignore[arg-type]


def test_wrapped_value_must_be_a_mapping() -> None:
    message = config_error({"kvplug": [1]})
    assert "'kvplug' must be a mapping" in message


def test_json_array_string_is_json_not_a_path() -> None:
    assert "top level must be a mapping" in config_error("[1, 2]")


def test_unsupported_source_type() -> None:
    message = config_error(42)
    assert "cannot load a config from int" in message
    assert "JSON" in message


def test_kvplug_key_beside_others_is_not_unwrapped() -> None:
    message = config_error({"kvplug": {}, "block_size": 16})
    assert "unknown key 'kvplug'" in message


def test_config_is_frozen() -> None:
    config = KVPlugConfig()
    with pytest.raises(Exception):  # noqa: B017 - pydantic's frozen-instance error
        config.block_size = 4  # type: ignore[misc]
