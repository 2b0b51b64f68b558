"""Tiny random-weight Hugging Face models for tests and CPU demos.

`build_tiny_model(path, arch)` writes a complete model directory (config.json, weights,
tokenizer files with a chat template) that vLLM and transformers load like any
downloaded checkpoint, without network access:

- ``"llama"``: a 2-layer `LlamaForCausalLM` (by default; see `build_tiny_model`);
- ``"gemma3"``: a 4-layer text-only `Gemma3ForCausalLM` (``model_type`` ``"gemma3_text"``)
  whose layers alternate sliding-window (window 64) and full attention, so vLLM builds a
  hybrid KV cache with one sliding-window group and one full-attention group.

The weights are random and the tokenizer is a byte-level BPE trained on generated text
(the same tokenizer for every seed), so the models produce gibberish, but they exercise
the real engine paths: prefix caching, block allocation, hybrid cache groups. head_dim is
32, the smallest size vLLM CPU attention supports. Everything is deterministic given `seed`.
torch, transformers and tokenizers are imported only when a model is built.

Running one in-process with vLLM CPU (about 2-4 s to start, after ~7 s to import vllm)::

    # env: VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=1
    path = build_tiny_model("/tmp/tiny-gemma3", arch="gemma3")
    llm = vllm.LLM(
        model=str(path),
        dtype="float32",  # "auto" would run float32 checkpoints in bfloat16 on CPU
        block_size=32,  # vLLM CPU needs a multiple of 32
        num_gpu_blocks_override=64,
        kv_cache_memory_bytes=64 * 2**20,  # skips the check that 92% of RAM is free
        max_model_len=1024,
        max_num_batched_tokens=256,  # lets gemma3's two groups fit in 64 blocks
        enforce_eager=True,
        seed=0,
    )
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

ARCHS = ("llama", "gemma3")

VOCAB_SIZE = 512
MAX_POSITIONS = 4096
SLIDING_WINDOW = 64
# Far above the usual 0.02: logits get spread out (std ~4), so greedy picks are decided by
# wide margins, not by rounding noise, and cached and uncached runs agree token for token.
INIT_STD = 0.5
# Gemma3 layer pattern: two sliding-window layers and two full-attention layers, so that
# vLLM's hybrid allocator makes exactly two KV cache groups of two layers each.
GEMMA3_LAYER_TYPES = [
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "full_attention",
]

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]  # ids 0, 1, 2, 3

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_VOCABULARY = """
the a an of to and in is was for on that with as by at from it this be are or have
cache block token prefix model layer window memory request page pool hash evict
small large fast slow first last next every other same new old long short
cat dog bird tree river house city road light night day time year world people
runs reads writes keeps finds takes gives makes holds moves sees knows wants
quickly slowly often never always again here there today
one two three four five six seven eight nine ten hundred
"""
_WORDS = _VOCABULARY.split()


def build_tiny_model(
    path: str | Path,
    arch: str = "llama",
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int | None = None,
) -> Path:
    """Write a tiny random-weight model of `arch` ("llama" or "gemma3") into `path`.

    The directory gets config.json, safetensors weights (float32), tokenizer files and
    generation_config.json. Returns `path` as a `Path`. Same arguments, same files.

    `hidden_size` (a multiple of 32, at least 64: heads of 32, half as many KV heads) and
    `num_layers` (llama: 2; gemma3: 4, a multiple of 2) make a model whose prefill costs
    more than the scheduler's step, as a real model's does: a server A/B then shows what
    saved prefill is worth in time (``hidden_size=256, num_layers=4``: 2.6M parameters,
    the README's server A/B).
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {', '.join(ARCHS)}")
    if hidden_size < 64 or hidden_size % 32:
        raise ValueError(f"hidden_size must be a multiple of 32, at least 64; got {hidden_size}")
    layers = num_layers if num_layers is not None else (2 if arch == "llama" else 4)
    if layers < 1 or (arch == "gemma3" and layers % 2):
        raise ValueError(
            f"num_layers must be at least 1 (gemma3: a multiple of 2, sliding and full "
            f"attention alternating); got {num_layers}"
        )

    import torch
    import transformers

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = _build_tokenizer()
    shared = {  # both architectures' sizes and special tokens
        "vocab_size": VOCAB_SIZE,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_attention_heads": hidden_size // 32,
        "num_key_value_heads": max(1, hidden_size // 64),
        "head_dim": 32,
        "max_position_embeddings": MAX_POSITIONS,
        "initializer_range": INIT_STD,
        # Tied embeddings make a random Gemma3 (which scales its inputs by
        # sqrt(hidden_size)) echo one token forever.
        "tie_word_embeddings": False,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    if arch == "llama":
        config: Any = transformers.LlamaConfig(num_hidden_layers=layers, **shared)
        model_cls: Any = transformers.LlamaForCausalLM
    else:
        config = transformers.Gemma3TextConfig(
            num_hidden_layers=layers,
            query_pre_attn_scalar=32,
            sliding_window=SLIDING_WINDOW,
            layer_types=GEMMA3_LAYER_TYPES[:2] * (layers // 2),
            **shared,
        )
        model_cls = transformers.Gemma3ForCausalLM
    config.architectures = [model_cls.__name__]

    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state alone
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32).eval()
    if arch == "llama":
        # Llama has no q/k norm: at INIT_STD its attention scores are so large that each query
        # attends to one token and the rest of the cached context has no effect. Shrink q and k
        # to about unit size so that attention spreads over the context.
        qk_scale = 1 / (INIT_STD * config.hidden_size**0.5)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(qk_scale)
                layer.self_attn.k_proj.weight.mul_(qk_scale)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _build_tokenizer() -> Any:
    """Train a byte-level BPE tokenizer on generated text; wrap it for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    # Prepend BOS the way Llama-style tokenizers do.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A $B:1",
        special_tokens=[(BOS, tok.token_to_id(BOS))],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=MAX_POSITIONS,
    )


def _corpus(lines: int = 2000) -> list[str]:
    """Deterministic English-like sentences to train the tokenizer on."""
    rng = random.Random(0)
    text = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        words[0] = words[0].capitalize()
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        text.append(" ".join(words) + rng.choice(".!?,;:"))
    return text
