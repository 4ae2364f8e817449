"""Counter-based random numbers for sampling: every draw is a pure function of (key, vocabulary id), where
the key comes from (the request's seed, the generated token's index).

No generator state moves between steps, so a token's draw does not depend on which other requests share
its batch, on preemption, or on whether speculation verified it as a draft; the CUDA kernel
(gpu/sampling.cu, `gumbel_noise`) computes the same function, bit for bit in the integer part.

- `row_key(seed, index)`: two 32-bit words from SplitMix64 of the seed and the index.
- per vocabulary id j: h = mix(mix(j ^ k0) ^ k1), `mix` the "lowbias32" integer hash (a bijection on 32
  bits, so ids never collide within a row); v = h / 2^32 + 2^-33 rounded to float32; E = -log1p(-v) is
  an exponential variable with full relative precision near 0 (where the winners come from); the Gumbel
  noise is -log(E). Its largest possible value is -log(-log1p(-2^-33)) < NOISE_MAX.
"""
from __future__ import annotations

import numpy as np

M64 = (1 << 64) - 1
NOISE_MAX = 23.0  # bound on the noise: v >= 2^-33 gives -log(E) <= 22.87


def splitmix64(x):
    """SplitMix64's finalizer on a Python int, or elementwise on a numpy uint64 array (whose arithmetic wraps as
    the masks do; call it under np.errstate(over="ignore"))."""
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def row_key(seed: int, index: int) -> tuple[int, int]:
    """The key of the draw for a request's `index`-th generated token (seed: any int, taken mod 2^64)."""
    return index_key(seed_key(seed), index)


def seed_key(seed: int) -> int:
    """The seed's half of row_key, the same for all its tokens (a sequence computes it once)."""
    return splitmix64(seed & M64)


def index_key(mixed_seed: int, index: int) -> tuple[int, int]:
    """row_key from seed_key(seed)."""
    z = splitmix64((mixed_seed + index) & M64)
    return z & 0xFFFFFFFF, z >> 32


def index_keys(mixed_seeds: np.ndarray, indexes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """index_key for many rows at once (uint64 arrays; numpy's uint64 arithmetic wraps as `& M64` does): the
    keys' two words as two uint32 arrays (row i's key is (lo[i], hi[i]))."""
    with np.errstate(over="ignore"):
        z = splitmix64(mixed_seeds + indexes)
    return (z & np.uint64(0xFFFFFFFF)).astype(np.uint32), (z >> np.uint64(32)).astype(np.uint32)


def mix32(xp, x):
    """lowbias32 (C. Wellons' hash prospector): uint32 in, uint32 out, wrapping multiplies."""
    x = x ^ (x >> 16)
    x = x * xp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * xp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def gumbel(xp, ids, key: tuple[int, int]):
    """float32 Gumbel noise for the uint32 vocabulary `ids` under `key`."""
    k0, k1 = xp.uint32(key[0]), xp.uint32(key[1])
    h = mix32(xp, mix32(xp, ids ^ k0) ^ k1)
    v = h.astype(xp.float32) * xp.float32(2.0**-32) + xp.float32(2.0**-33)
    with np.errstate(divide="ignore"):
        return -xp.log(-xp.log1p(-v))
