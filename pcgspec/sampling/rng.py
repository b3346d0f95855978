"""Counter-based uniform random numbers: one draw per (seed, output position, stream).

The function is pure 32-bit integer arithmetic so that a Triton kernel reproduces it bit for
bit. Let ``mix`` be Wellons' two-round 32-bit permutation (hash-prospector), on uint32 with
wrapping multiplies::

    mix(x) = x ^= x >> 16; x *= 0x21F0AAAD; x ^= x >> 15; x *= 0x735A2D97; x ^= x >> 15

Let ``seed`` be read as 64-bit two's complement, ``seed_lo``/``seed_hi`` its bits 0-31/32-63,
``pos`` bits 0-31 of the position, ``stream`` a uint32. Then::

    h = mix(seed_lo ^ 0x9E3779B9)
    h = mix(h ^ seed_hi)
    h = mix(h ^ stream)
    h = mix(h ^ pos)
    u = float32((h >> 9) + 0.5) * 2**-23        # in [2**-24, 1 - 2**-24], exact in float32

Every step is a bijection of ``h``, so for one (seed, stream) the 2**32 positions give 2**32
distinct hashes. 23 bits (not 24) keep ``u`` exactly representable and strictly below 1.
"""

from __future__ import annotations

import torch

STREAM_TOKEN = 0  # the token draw of sampling
STREAM_ACCEPT = 1  # speculative verification: the acceptance test of a draft token
STREAM_RESAMPLE = 2  # speculative verification: the resample after a rejection

_MASK32 = 0xFFFFFFFF
_SEED_SALT = 0x9E3779B9
_MUL1 = 0x21F0AAAD
_MUL2 = 0x735A2D97
# NOTE: both multipliers are < 2**31, so a uint32 times one of them is < 2**63: the int64
# product is exact (no signed overflow) and masking it gives the uint32 wrapping product.


def _mix(x: torch.Tensor) -> torch.Tensor:
    """``mix`` of the module docstring on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & _MASK32
    return x ^ (x >> 15)


def hash32(seed: torch.Tensor, position: torch.Tensor, stream: int | torch.Tensor) -> torch.Tensor:
    """The 32-bit hash ``h`` of the module docstring, as int64 in [0, 2**32). Broadcasts."""
    if isinstance(stream, int):
        stream = stream & _MASK32
    else:
        stream = stream.to(torch.int64) & _MASK32
    seed = seed.to(torch.int64)
    h = _mix((seed & _MASK32) ^ _SEED_SALT)
    h = _mix(h ^ ((seed >> 32) & _MASK32))
    h = _mix(h ^ stream)
    return _mix(h ^ (position.to(torch.int64) & _MASK32))


def uniform(
    seed: torch.Tensor, position: torch.Tensor, stream: int | torch.Tensor = STREAM_TOKEN
) -> torch.Tensor:
    """One float32 uniform in (0, 1) per (seed, position, stream); seed/position [R] int64.

    The draw depends only on these three values, never on the batch it is computed in.
    """
    h = hash32(seed, position, stream)
    return ((h >> 9).to(torch.float32) + 0.5) * 2.0**-23
