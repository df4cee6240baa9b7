"""Random generators that protect privacy, keyed from the operating system's entropy pool.

Two ways to make them, both AES-128 in counter mode under a fresh 128-bit key from
:mod:`secrets` — never a seed that anyone chose, stored or could see:

- :func:`secure_generator`: a numpy ``Generator`` over ``randomgen.AESCounter``, for draws
  that need numpy's API (integers, uniforms, Bernoulli indicators, choices);
- :class:`Keystream`: the cipher's raw keystream from OpenSSL (through ``cryptography``), for
  bulk draws — the Gaussian noise of every private step. OpenSSL's AES-CTR runs several
  blocks at once with AES-NI (VAES where the CPU has it) and releases the GIL, where
  ``randomgen``'s holds the GIL while it fills (their speeds: ``bench/noise_cost.py``).

Why these generators, and how the engine draws from them: :mod:`workers.dp.randomness`. This
module lives here, without torch, because the tuning job's driver draws from
:func:`secure_generator` too (the K of a random-stopping job, the candidates of a grid or
random search) and does not import torch.
"""

from __future__ import annotations

import secrets

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, CipherContext, algorithms, modes
from randomgen import AESCounter

#: AES's block: OpenSSL may write up to a block beyond what one call returns
BLOCK = 16
#: what a keystream encrypts: zeros, shared by the process's keystreams and grown on demand.
#: Its pages are never written, so reading them maps the kernel's one zero page: they add
#: nothing to the process's resident memory.
_zeros = b""


def secure_generator() -> np.random.Generator:
    """An independent generator: AES-128-CTR under a fresh key from OS entropy."""
    return np.random.Generator(AESCounter(key=secrets.randbits(128), counter=0))


def aes_ctr(key: bytes, block: int = 0) -> CipherContext:
    """AES-CTR encryption under ``key`` from counter block ``block``: encrypting zeros gives the
    keystream AES_k(block), AES_k(block + 1), … (the counter a big-endian 128-bit integer)."""
    return Cipher(algorithms.AES(key), modes.CTR(block.to_bytes(BLOCK, "big"))).encryptor()


def _zero_bytes(nbytes: int) -> bytes:
    """At least ``nbytes`` zeros (the plaintext of a keystream), grown on demand."""
    global _zeros
    zeros = _zeros
    if len(zeros) < nbytes:
        zeros = _zeros = bytes(nbytes)
    return zeros


class Keystream:
    """AES-128-CTR's keystream, as bytes on demand: the encryption of zeros. Its key is fresh
    from OS entropy unless one is given (the product never gives one; a test replays a stream
    with its key). Output reveals nothing about the key, and no two fresh keystreams share one
    (2⁻¹²⁸ per pair).

    The stream is read in order (:meth:`next`), or its next bytes are claimed (:meth:`claim`)
    and read later, from any thread, in any order (:meth:`read`): CTR's keystream at byte s is
    AES_k(⌊s/16⌋) onwards, so a draw split in parts can be made by two threads at once, each
    part from its own place in the stream. Every byte is given out once: a claim moves the
    stream past the bytes it claims."""

    def __init__(self, key: bytes | None = None) -> None:
        self._key = secrets.token_bytes(16) if key is None else key
        self._position = 0  # bytes given out or claimed so far

    @property
    def key(self) -> bytes:
        """The cipher's key (for benches and tests that rebuild draws from it): never stored,
        logged or sent anywhere."""
        return self._key

    def claim(self, nbytes: int) -> int:
        """Claim the stream's next ``nbytes`` bytes (for :meth:`read`); where they start."""
        start, self._position = self._position, self._position + nbytes
        return start

    def read(self, start: int, nbytes: int) -> np.ndarray:
        """The ``nbytes`` bytes of the stream from byte ``start`` (claimed), in a new array
        whose start is aligned for 8-byte words, so wider words view it in place."""
        return self.reader(start).read(nbytes, buffer(nbytes))

    def reader(self, start: int) -> Reader:
        """A reader of the stream from byte ``start`` on (claimed), part after part."""
        return Reader(self._key, start)

    def next(self, nbytes: int) -> np.ndarray:
        """The stream's next ``nbytes`` bytes (:meth:`read` of a :meth:`claim`)."""
        return self.read(self.claim(nbytes), nbytes)


def buffer(nbytes: int) -> np.ndarray:
    """A byte buffer that :meth:`Reader.read` can read up to ``nbytes`` bytes into (OpenSSL may
    write a block more), its start aligned for 8-byte words, so that wider words view what is
    read in place."""
    raw = np.empty(nbytes + BLOCK + 8, dtype=np.uint8)
    shift = -raw.ctypes.data % 8
    return raw[shift : shift + nbytes + BLOCK]


class Reader:
    """Reads a keystream on from a byte, part after part, through one cipher context (making
    one costs what reading some 50 KiB of keystream does, and a draw reads a chunk's words in
    pieces: ``workers.gaussian.make``)."""

    def __init__(self, key: bytes, start: int) -> None:
        block, lead = divmod(start, BLOCK)
        self._context = aes_ctr(key, block)
        if lead:  # the block's first bytes belong to an earlier claim
            self._context.update(_zero_bytes(lead)[:lead])

    def read(self, nbytes: int, into: np.ndarray) -> np.ndarray:
        """The stream's next ``nbytes`` bytes, written at the start of ``into`` (a
        :func:`buffer` for at least ``nbytes``); that part of ``into``."""
        written = self._context.update_into(memoryview(_zero_bytes(nbytes))[:nbytes], into.data)
        if written != nbytes:  # CTR is a stream mode: every byte in gives one out
            raise RuntimeError(f"AES-CTR gave {written} bytes of {nbytes}")
        return into[:nbytes]
