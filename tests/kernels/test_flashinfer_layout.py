"""FlashInfer's paged-KV metadata, built on CPU, and the engine hooks' CPU behaviour.

FlashInfer itself runs only on a GPU, so these tests check the translation: a sequence
read through ``(indptr, indices, last_page_len)`` the way FlashInfer documents it must
see exactly the tokens the block table gives it.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from kvplug.kernels import engine_hooks

torch = pytest.importorskip("torch")

from kvplug.kernels.layout import (  # noqa: E402  (needs torch)
    FlashInferPages,
    flashinfer_pages,
    new_token_slots,
    token_pages_to_pages,
)


def test_hand_worked_example() -> None:
    # page size 4; lengths 1, 4 (one full page) and 9 (two full pages and one token)
    table = torch.tensor([[7, 0, 0], [2, 0, 0], [5, 1, 3]], dtype=torch.int32)
    lens = torch.tensor([1, 4, 9], dtype=torch.int32)
    pages = flashinfer_pages(table, lens, page_size=4)
    assert pages.indptr.tolist() == [0, 1, 2, 5]
    assert pages.indices.tolist() == [7, 2, 5, 1, 3]
    assert pages.last_page_len.tolist() == [1, 4, 1]
    assert {t.dtype for t in (pages.indptr, pages.indices, pages.last_page_len)} == {torch.int32}


def tokens_as_flashinfer_reads_them(pages: FlashInferPages, page_size: int) -> list[list[int]]:
    """Global slot ids (block * page_size + slot) each sequence attends to, in order."""
    sequences = []
    for b in range(len(pages.last_page_len)):
        ids = pages.indices[pages.indptr[b] : pages.indptr[b + 1]].tolist()
        slots = [block * page_size + s for block in ids for s in range(page_size)]
        sequences.append(slots[: (len(ids) - 1) * page_size + int(pages.last_page_len[b])])
    return sequences


def tokens_from_block_table(table: torch.Tensor, lens: torch.Tensor, page_size: int):
    return [
        [int(table[b, p // page_size]) * page_size + p % page_size for p in range(int(n))]
        for b, n in enumerate(lens)
    ]


@pytest.mark.parametrize("page_size", [1, 8, 16, 24, 32, 64, 128, 256])
def test_flashinfer_reads_what_the_block_table_holds(page_size: int) -> None:
    gen = torch.Generator().manual_seed(page_size)
    lens = torch.tensor([1, page_size, page_size + 1, 3 * page_size - 1, 5], dtype=torch.int32)
    width = int((lens + page_size - 1).max()) // page_size + 2
    # shuffled, distinct block ids; the padding columns hold -1 and must be ignored
    table = torch.randperm(len(lens) * width, generator=gen).reshape(len(lens), width).int()
    used = torch.arange(width)[None, :] < ((lens + page_size - 1) // page_size)[:, None]
    table[~used] = -1
    pages = flashinfer_pages(table, lens, page_size)
    assert pages.indptr.shape == (len(lens) + 1,)
    assert int(pages.indptr[-1]) == len(pages.indices)
    assert ((pages.last_page_len >= 1) & (pages.last_page_len <= page_size)).all()
    assert (pages.indices >= 0).all()
    expected = tokens_from_block_table(table, lens, page_size)
    assert tokens_as_flashinfer_reads_them(pages, page_size) == expected


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_token_level_metadata_regroups_into_pages(page_size: int) -> None:
    """SGLang-style metadata (one slot per token, page-aligned slots) -> real pages."""
    lens = torch.tensor([3, page_size, 2 * page_size + 1], dtype=torch.int32)
    pages_each = (lens + page_size - 1) // page_size
    blocks = torch.randperm(int(pages_each.sum()) + 3, generator=torch.Generator().manual_seed(1))
    table = torch.zeros(len(lens), int(pages_each.max()), dtype=torch.int32)
    token_slots, start = [], 0
    for b, n in enumerate(lens.tolist()):
        table[b, : pages_each[b]] = blocks[start : start + pages_each[b]]
        start += int(pages_each[b])
        token_slots += [int(table[b, p // page_size]) * page_size + p % page_size for p in range(n)]
    token_indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    token_indptr[1:] = torch.cumsum(lens, 0)
    regrouped = token_pages_to_pages(token_indptr, torch.tensor(token_slots), page_size)
    direct = flashinfer_pages(table, lens, page_size)
    for got, want in zip(
        (regrouped.indptr, regrouped.indices, regrouped.last_page_len),
        (direct.indptr, direct.indices, direct.last_page_len),
        strict=True,
    ):
        assert got.tolist() == want.tolist()


def test_new_token_slots_are_the_last_positions() -> None:
    table = torch.tensor([[4, 9, 2], [6, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([10, 3], dtype=torch.int32)  # after the append
    qo = torch.tensor([0, 3, 5], dtype=torch.int32)  # 3 new tokens, then 2
    blocks, slots = new_token_slots(table, lens, qo, page_size=4)
    # sequence 0: positions 7, 8, 9; sequence 1: positions 1, 2
    assert list(zip(blocks.tolist(), slots.tolist(), strict=True)) == [
        (9, 3),
        (2, 0),
        (2, 1),
        (6, 1),
        (6, 2),
    ]


# -- engine hooks ----------------------------------------------------------------------


def test_importing_the_kernels_imports_no_engine_and_no_kernel_library() -> None:
    code = (
        "import sys, kvplug.kernels, kvplug.kernels.engine_hooks\n"
        "heavy = ('torch', 'vllm', 'sglang', 'triton', 'flashinfer')\n"
        "print(','.join(m for m in heavy if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""


def test_hooks_say_why_they_cannot_run() -> None:
    for status, register in (
        (engine_hooks.vllm_hook_status(), engine_hooks.register_vllm_backend),
        (engine_hooks.sglang_hook_status(), engine_hooks.register_sglang_backend),
    ):
        if status == "available":
            continue  # a GPU machine with the engine installed
        assert status.startswith("needs ")
        with pytest.raises(engine_hooks.EngineHookError, match=re.escape(status)):
            register()
    if engine_hooks.vllm_hook_status() != "available":
        with pytest.raises(engine_hooks.EngineHookError):
            engine_hooks.KVPlugFlashInferBackend  # noqa: B018  (resolving it is the test)
        engine_hooks.vllm_plugin()  # the entry-point form never raises


class RecordingWrapper:
    """Stands in for a FlashInfer wrapper and records what it was given."""

    def __init__(self) -> None:
        self.planned: tuple | None = None
        self.ran_with: tuple | None = None
        self.extra = "passed through"

    def plan(self, *args, **kwargs):
        self.planned = (args, kwargs)

    def run(self, q, kv_cache):
        self.ran_with = (q, kv_cache)
        return q


def test_page_size_adapter_plans_and_runs_real_pages() -> None:
    page_size = 4
    token_indptr = torch.tensor([0, 5, 9], dtype=torch.int32)
    token_slots = torch.tensor([8, 9, 10, 11, 20, 4, 5, 6, 7])  # pages 2, 5 and page 1
    inner = RecordingWrapper()
    adapter = engine_hooks.PageSizeAdapter(inner, page_size, has_qo_indptr=False)
    adapter.begin_forward(token_indptr, token_slots, torch.ones(2), 8, 2, 16, 1, data_type="x")
    args, kwargs = inner.planned
    assert args[0].tolist() == [0, 2, 3]
    assert args[1].tolist() == [2, 5, 1]
    assert args[2].tolist() == [1, 4]
    assert args[3:] == (8, 2, 16, page_size)
    assert kwargs == {"data_type": "x"}

    k_buffer = torch.zeros(24, 2, 16)
    adapter.forward(torch.zeros(2, 8, 16), (k_buffer, k_buffer))
    _, (k, v) = inner.ran_with
    assert k.shape == v.shape == (6, page_size, 2, 16)
    assert adapter.extra == "passed through"

    prefill = engine_hooks.PageSizeAdapter(RecordingWrapper(), page_size, has_qo_indptr=True)
    qo = torch.tensor([0, 1, 2], dtype=torch.int32)
    prefill.plan(qo, token_indptr, token_slots, torch.ones(2), 8, 2, 16, page_size=1)
    args, kwargs = prefill._wrapper.planned
    assert args[0] is qo and args[2].tolist() == [2, 5, 1]
    assert kwargs == {"page_size": page_size}
