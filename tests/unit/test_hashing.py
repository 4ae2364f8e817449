"""cache.hashing: chain_hashes (packed once, XXH3) names every block exactly as block_hash does block by block, the
definition the engine registers blocks under."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cache.hashing import ROOT_HASH, block_hash, chain_hashes, chain_hashes_packed, pack_tokens

PINNED = (4026488454294238488, 696667317655561177)  # block_hash(0, [1, 2, 3, 4]), block_hash(12345, [2**32-1] * 16)


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


def test_the_definition_is_xxh3_of_little_endian_ids_seeded_by_the_parent():
    """The documented definition, written independently (struct, not array), plus two pinned values: a
    change here re-keys every cache and splits a fleet running two versions, so it must be deliberate."""
    import struct

    from xxhash import xxh3_64_intdigest

    tokens = [7, 0, 2**32 - 1, 123456]
    assert block_hash(99, tokens) == xxh3_64_intdigest(struct.pack("<4I", *tokens), 99) >> 1
    assert block_hash(0, [1, 2, 3, 4]) == PINNED[0]
    assert block_hash(12345, [2**32 - 1] * 16) == PINNED[1]


@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=100), block=st.integers(1, 17),
       cut=st.integers(0, 6))
def test_packed_chain_continues_from_any_block(tokens, block, cut):
    """SessionHashes packs a prompt once and hashes only the blocks past its reused ones."""
    whole = chain_hashes(tokens, block)
    k = min(cut, len(whole))
    parent = whole[k - 1] if k else ROOT_HASH
    assert whole[:k] + chain_hashes_packed(pack_tokens(tokens)[4 * k * block:], block, parent) == whole


def test_a_model_identity_seeds_both_chains_so_two_models_never_share_a_block():
    from cache.hashing import ROOT_KEY, ChainRoot, chain_key, chain_root

    assert chain_root("") == ChainRoot(ROOT_HASH, ROOT_KEY)  # no identity: the unseeded chains
    a, b = chain_root("gguf:1:aa"), chain_root("gguf:1:ab")
    assert a == chain_root("gguf:1:aa") and a != b and 0 <= a.hash < 2**63 and len(a.key) == 16
    ids = list(range(64))  # the same prompt ids under two models sharing a tokenizer
    ha, hb = chain_hashes(ids, 16, a.hash), chain_hashes(ids, 16, b.hash)
    assert len(ha) == 4 and not set(ha) & set(hb) and not set(ha) & set(chain_hashes(ids, 16))
    assert chain_key(a.key, pack_tokens(ids[:16])) != chain_key(b.key, pack_tokens(ids[:16]))
