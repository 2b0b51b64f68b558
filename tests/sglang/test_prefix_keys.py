"""SGLang's prefix keys: a prefix's key is the same wherever the nodes holding it split, and
a new node finds the keys where recent victims ended."""

from __future__ import annotations

from array import array

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplug.sglang.prefix_keys import (
    CHUNK_TOKENS,
    VictimEnds,
    chunk_tokens,
    extend,
    node_prefix,
    root_prefix,
)

TOKENS = st.lists(st.integers(0, 2**31 - 1), max_size=3 * CHUNK_TOKENS)


@given(
    tokens=TOKENS.filter(len),
    cuts=st.lists(st.integers(0, 3 * CHUNK_TOKENS), max_size=4),
    page=st.sampled_from([1, 4, 16, 96]),
)
@settings(deadline=None)
def test_a_prefix_s_key_does_not_depend_on_where_its_nodes_split(tokens, cuts, page) -> None:
    """Nodes holding the same tokens, split anywhere, end at the same prefix and key;
    an int64 numpy array and an ``array('q')`` hash alike."""
    root = root_prefix("adapter", None)
    whole, _ = node_prefix(root, 0, array("q", tokens), page)
    assert node_prefix(root, 0, np.array(tokens, dtype=np.int64), page)[0] == whole
    bounds = sorted({c % len(tokens) for c in cuts} | {0, len(tokens)})
    prefix = root
    for a, b in zip(bounds, bounds[1:], strict=False):
        prefix, _ = node_prefix(prefix, a, array("q", tokens[a:b]), page)
    assert prefix == whole
    assert len(whole.tail) == 8 * (len(tokens) % chunk_tokens(page))


def test_keys_differ_by_tokens_length_and_namespace() -> None:
    tokens = array("q", range(200))
    chunk = chunk_tokens(1)
    keys = {
        extend(root_prefix(extra, salt), tokens[:n], chunk).key
        for extra, salt in [(None, None), ("lora-a", None), (None, "tenant-1")]
        for n in (0, 1, 63, 64, 65, 200)
    }
    assert len(keys) == 18
    assert (
        extend(root_prefix(None, None), array("q", [1, 2]), chunk).key
        != extend(root_prefix(None, None), array("q", [2, 1]), chunk).key
    )


def test_a_new_node_finds_the_keys_where_victims_ended_on_a_page_boundary() -> None:
    page = 4
    tokens = array("q", range(100, 240))  # 35 pages, over two chunks
    chunk = chunk_tokens(page)
    root = root_prefix(None, None)
    ends = VictimEnds(capacity=8)
    # victims that held the first 3 and the first 20 pages, one ending mid-page, and one
    # of another prefix of the same length as the first
    victim_keys = [extend(root, tokens[:n], chunk).key for n in (12, 80)]
    for end in (12, 80, 82):
        ends.add(end, tokens[end - 1])
    ends.add(12, 7)
    whole, inside = node_prefix(root, 0, tokens, page, ends)
    assert inside == victim_keys
    assert whole == extend(root, tokens, chunk)
    # a node starting later looks up only the victims ending after its start
    assert node_prefix(extend(root, tokens[:8], chunk), 8, tokens[8:], page, ends)[1] == (
        victim_keys
    )
    assert node_prefix(extend(root, tokens[:12], chunk), 12, tokens[12:], page, ends)[1] == [
        victim_keys[1]
    ]


def test_victim_ends_keep_the_last_capacity_victims() -> None:
    ends = VictimEnds(capacity=3)
    tokens = list(range(3000))
    for end in (5, 9, 5, 2000):  # the first 5 leaves
        ends.add(end, end - 1)
    assert ends.inside(0, tokens) == [5, 9, 2000]
    assert ends.inside(5, tokens[5:2000]) == [9]
    assert ends.inside(0, [t + 1 for t in tokens]) == []  # the same ends, other tokens
    ends.add(7, 6)  # 9 leaves, one 5 stays
    assert ends.inside(0, tokens) == [5, 7, 2000]
    assert ends.marks == {(5, 4): 1, (7, 6): 1, (2000, 1999): 1}
    assert ends.ends == [5, 7, 2000]
