"""kvplug.tools.tiny_model: the tiny random-weight models load with transformers.

Needs torch, transformers and tokenizers (the vLLM environment has them); skipped otherwise.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.engine_vllm
pytest.importorskip("torch")
pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from kvplug.tools.tiny_model import ARCHS, build_tiny_model  # noqa: E402

TEXT = 'Hello, World! The cache\'s 12345 blocks ~ {x: [1, 2]}\n\ttabs & "quotes" ok?'


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {arch: build_tiny_model(tmp_path_factory.mktemp(arch), arch) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_writes_a_loadable_model_dir(models, arch):
    path = models[arch]
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names

    config = transformers.AutoConfig.from_pretrained(path)
    expected = {"llama": "LlamaForCausalLM", "gemma3": "Gemma3ForCausalLM"}[arch]
    assert config.architectures == [expected]
    assert config.head_dim >= 32

    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert len(tok) <= config.vocab_size
    ids = tok(TEXT).input_ids
    assert ids[0] == tok.bos_token_id == config.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == TEXT
    assert tok.eos_token_id == config.eos_token_id

    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "hi" in chat and chat.endswith("<|assistant|>\n")


def test_gemma3_has_sliding_and_full_layers(models):
    config = transformers.AutoConfig.from_pretrained(models["gemma3"])
    assert config.model_type == "gemma3_text"
    assert set(config.layer_types) == {"sliding_attention", "full_attention"}
    assert config.sliding_window in (64, 128)


def test_same_seed_same_weights(tmp_path):
    a = build_tiny_model(tmp_path / "a", "llama", seed=1)
    b = build_tiny_model(tmp_path / "b", "llama", seed=1)
    c = build_tiny_model(tmp_path / "c", "llama", seed=2)
    weights = [(p / "model.safetensors").read_bytes() for p in (a, b, c)]
    assert weights[0] == weights[1] != weights[2]
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_unknown_arch_raises(tmp_path):
    with pytest.raises(ValueError, match="llama, gemma3"):
        build_tiny_model(tmp_path, "mamba")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(("arch", "layers"), [("llama", 3), ("gemma3", 6)])
def test_a_larger_size_keeps_head_dim_and_layer_pattern(tmp_path, arch, layers):
    path = build_tiny_model(tmp_path, arch, hidden_size=256, num_layers=layers)
    config = transformers.AutoConfig.from_pretrained(path)
    assert (config.hidden_size, config.num_hidden_layers) == (256, layers)
    assert (config.head_dim, config.num_attention_heads, config.num_key_value_heads) == (32, 8, 4)
    if arch == "gemma3":
        assert config.layer_types == ["sliding_attention", "full_attention"] * 3


@pytest.mark.parametrize(
    ("size", "match"),
    [
        ({"hidden_size": 100}, "hidden_size must be a multiple of 32"),
        ({"num_layers": 0}, "num_layers must be at least 1"),
        ({"arch": "gemma3", "num_layers": 3}, "a multiple of 2"),
    ],
)
def test_a_bad_size_is_refused_before_writing(tmp_path, size, match):
    with pytest.raises(ValueError, match=match):
        build_tiny_model(tmp_path, **size)
    assert not any(tmp_path.iterdir())
