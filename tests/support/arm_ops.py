"""Random request sequences for the replay arms that drive SGLang's radix cache.

Operations, as `tests/test_sglang_stock.py` and `tests/test_sglang_kvplug.py` interpret
them:

- ``("admit", prefix, cut, tail, sentinel)``: prompt = ``prefixes[prefix][:cut] + tail``,
  then either a fresh sentinel and compute = len(prompt) - 1 (sequential replay) or no
  sentinel and compute = len(prompt) (realistic replay);
- ``("grow", pick, n)``: n fresh decode units for running request number `pick`;
- ``("finish", pick)``: finish running request number `pick`.
"""

from __future__ import annotations

from collections.abc import Iterator

from hypothesis import strategies as st

admit_ops = st.tuples(
    st.just("admit"),
    st.integers(0, 2),
    st.integers(1, 8),
    st.lists(st.integers(0, 5), max_size=3),
    st.booleans(),
)
grow_ops = st.tuples(st.just("grow"), st.integers(0, 7), st.integers(1, 3))
finish_ops = st.tuples(st.just("finish"), st.integers(0, 7))
operations = st.lists(st.one_of(admit_ops, admit_ops, grow_ops, finish_ops), max_size=40)
prefix_sets = st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=8), min_size=1, max_size=3)


def admit_request(op: tuple, prefixes: list[list[int]], fresh: Iterator[int]) -> tuple[list, int]:
    """(prompt, compute) of an ``admit`` operation, as the module doc says."""
    _, which, cut, tail, sentinel = op
    prompt = prefixes[which % len(prefixes)][:cut] + tail
    compute = len(prompt)
    if sentinel:
        prompt.append(next(fresh))
    return prompt, compute
