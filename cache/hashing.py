"""The block hash chain: one definition shared by the engine (which caches blocks) and the router.

A block is `block_size` consecutive token ids. Its hash covers its parent's hash and its own tokens, so
one hash names the whole prefix up to and including that block. Only full blocks are hashed.

The hash is XXH3-64 of the block's token ids (4 bytes each, little-endian) seeded with the parent's hash,
shifted to 63 bits. It is not cryptographic (its seed is public), and need not be: it names blocks for
routing, where a collision can only misroute a request. Speed is what matters there: the gateway hashes a
prompt's new blocks inside every routing decision, and XXH3 takes one C call per block (~0.2 us) where
blake2b through struct took ~1 us.

Reusing KV is different: a block's K/V depend on every token before it, so the engine reuses a cached block
only when its `chain_key` matches too: BLAKE2b-128 over the parent's key and the block's tokens, so equal
keys mean the whole prefix is equal (a forged or chance XXH3 collision cannot attach another prefix's KV).
It costs one more C call per block, on the engine only (a few us a block, against the block's prefill).

Both chains start from the model's ChainRoot (`chain_root(identity)`, identity: the GGUF's content digest,
workers.protocol.model), not from zero: the same prompt ids under two models (two fine-tunes sharing a
tokenizer) name different blocks, so the prefix index never lists one model's blocks for the other's prompt
and no engine or checkpoint store can attach another model's KV. Seeding costs nothing per block: the root is
only the first block's parent. The gateway takes the root hash from the worker's WorkerInfo.prefix_seed, so
router and worker agree on it by construction.
"""
from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence
from typing import NamedTuple

from xxhash import xxh3_64_intdigest

ROOT_HASH = 0  # the root of a chain with no model identity (tests, the load-test backend)
ROOT_KEY = bytes(16)


class ChainRoot(NamedTuple):
    """The first block's parent in both chains: `hash` for block_hash, `key` for chain_key."""

    hash: int = ROOT_HASH
    key: bytes = ROOT_KEY


def chain_root(identity: str) -> ChainRoot:
    """The root of a model's chains, from its identity ("" : the unseeded ROOT_HASH / ROOT_KEY).

    One BLAKE2b-256 of the identity: its first 8 bytes (63 bits, like every block hash) seed the routing
    chain, the next 16 the KV-reuse chain."""
    if not identity:
        return ChainRoot()
    d = hashlib.blake2b(identity.encode(), digest_size=32, person=b"pulse-chain").digest()
    return ChainRoot(int.from_bytes(d[:8], "little") >> 1, d[8:24])


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    """Hash of one full block given its parent's hash (ROOT_HASH for the first block): a 63-bit int."""
    return _digest(parent, struct.pack(f"<{len(tokens)}I", *tokens))


def _digest(parent: int, payload: bytes) -> int:
    """The one place the block hash is defined: XXH3-64 of the packed ids, seeded by the parent, 63 bits."""
    return xxh3_64_intdigest(payload, parent) >> 1


def chain_hashes(tokens: Sequence[int], block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """Hashes of every full block of `tokens`, in order; a trailing partial block is not hashed.

    The same hashes as block_hash block by block, with the tokens packed once (the router hashes every new
    conversation's whole prompt)."""
    n = (len(tokens) // block_size) * block_size
    return chain_hashes_packed(pack_tokens(tokens[:n]), block_size, parent)


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as block_hash hashes them: uint32 little-endian. array() converts a list ~4x faster than
    struct.pack(*tokens) (~0.1 ms for 16k ids)."""
    packed = array("I", tokens)
    if packed.itemsize != 4:  # C unsigned int is 4 bytes on every platform Pulse runs on; say so if not
        raise RuntimeError("array('I') is not 32-bit here")
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def chain_hashes_packed(raw: bytes, block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """chain_hashes over ids already packed by pack_tokens (a trailing partial block is not hashed)."""
    step = 4 * block_size
    hashes: list[int] = []
    for start in range(0, len(raw) - step + 1, step):
        parent = _digest(parent, raw[start : start + step])
        hashes.append(parent)
    return hashes


def chain_key(parent_key: bytes, packed_block: bytes) -> bytes:
    """The collision-resistant identity of a block and its whole prefix: BLAKE2b-128 of the parent's key
    and the block's ids as pack_tokens packs them (ROOT_KEY is the first block's parent)."""
    return hashlib.blake2b(parent_key + packed_block, digest_size=16).digest()
