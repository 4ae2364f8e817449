"""The block hash chain: one definition shared by the engine (which caches blocks) and the router.

A block is `block_size` consecutive token ids. Its hash covers its parent's hash and its own tokens, so
one hash names the whole prefix up to and including that block. Only full blocks are hashed.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_HASH = 0


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    """Hash of one full block given its parent's hash (ROOT_HASH for the first block): a 63-bit int."""
    return _digest(_PARENT.pack(parent) + struct.pack(f"<{len(tokens)}I", *tokens))


_PARENT = struct.Struct("<q")


def _digest(payload: bytes) -> int:
    """The hash of a block's payload: its parent's hash (8 bytes) then its token ids (4 bytes each).
    blake2b is in the standard library, stable across processes and machines (unlike hash()), and fast."""
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little") >> 1


def chain_hashes(tokens: Sequence[int], block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """Hashes of every full block of `tokens`, in order; a trailing partial block is not hashed.

    The same hashes as block_hash block by block, with the tokens packed once: the router hashes every new
    conversation's whole prompt, and one struct.pack per block made that ~3.5 us a block."""
    n = (len(tokens) // block_size) * block_size
    raw = struct.pack(f"<{n}I", *tokens[:n])
    step, pack = 4 * block_size, _PARENT.pack
    hashes: list[int] = []
    for start in range(0, 4 * n, step):
        parent = _digest(pack(parent) + raw[start : start + step])
        hashes.append(parent)
    return hashes

