"""cache.hashing: chain_hashes (packed once) names every block exactly as block_hash does block by block, the
definition the engine registers blocks under."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cache.hashing import ROOT_HASH, block_hash, chain_hashes


@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=200), block=st.integers(1, 33),
       parent=st.integers(0, 2**63 - 1) | st.just(ROOT_HASH))
def test_chain_equals_block_by_block(tokens, block, parent):
    want, h = [], parent
    for start in range(0, len(tokens) - block + 1, block):
        h = block_hash(h, tokens[start:start + block])
        want.append(h)
    assert chain_hashes(tokens, block, parent) == want


def test_a_hash_names_the_whole_prefix():
    a, b = chain_hashes([1, 2, 3, 4, 5, 6], 2), chain_hashes([9, 2, 3, 4, 5, 6], 2)
    assert len(a) == 3 and all(x != y for x, y in zip(a, b))  # one changed token changes every later block
    assert all(0 <= x < 2**63 for x in a)
