"""Token counts with the model directory's own tokenizer, for sizing workload prompts."""

from __future__ import annotations

from pathlib import Path

from kvplug.serving.workload import TokenCounter, whitespace_tokens


def load_token_counter(model_dir: str | Path) -> tuple[TokenCounter, str]:
    """A function counting a text's tokens (no special tokens), and where it came from.

    Uses ``tokenizer.json`` through the `tokenizers` library when both are there, else
    transformers' ``AutoTokenizer``, else one token per word (counts are then estimates;
    the report always uses the server's own counts).
    """
    path = Path(model_dir)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        Tokenizer = None
    if Tokenizer is not None and (path / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        return (
            lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids),
            "tokenizer.json",
        )
    try:
        from transformers import AutoTokenizer

        auto = AutoTokenizer.from_pretrained(str(path))
    except Exception:  # not installed, or no tokenizer in the directory
        return whitespace_tokens, "one token per word (no tokenizer found)"
    return lambda text: len(auto.encode(text, add_special_tokens=False)), "AutoTokenizer"
