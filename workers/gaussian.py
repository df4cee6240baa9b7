"""Standard normals from an AES-CTR keystream by the Box–Muller transform, in numpy, and the
child process that draws a trial's next noise beside its step (:func:`serve`).

No torch here: the child imports this module, and starts in a fraction of the time torch would
take to import.

A draw is made in chunks of at most ``CHUNK`` Gaussian pairs: r·cos θ for a chunk's first
half, r·sin θ for its second. Each pair takes 8 bytes of keystream for its radius, then
(after the chunk's radii) 4 for its angle, 8 when the output is float64 (:func:`radii`,
:func:`angles`). A draw's bytes are claimed at once, the chunks' in order (:func:`plan`), so
they are the bytes one reader of the stream would have read.
"""

from __future__ import annotations

import math
import mmap
import sys
import traceback

import numpy as np

from core.entropy import Keystream, buffer

#: Gaussian pairs drawn per chunk (768 KiB of keystream for float32 noise)
CHUNK = 1 << 16
#: Gaussian pairs the child makes at once (:func:`make`): its buffers hold a quarter of a
#: chunk's words and angles, so the child takes less memory beside the step, for a few more calls
PIECE = 1 << 14
#: the child's replies (:func:`serve`): started, a draw made, a draw failed
READY, MADE, FAILED = b"r", b"!", b"x"
#: a chunk: its start and stop in the output, and the keystream byte its words start at
Chunk = tuple[int, int, int]
#: a radius's uniform v = m·2⁻⁵³ from a 64-bit word w: m = (w >> RADIUS_SHIFT) + RADIUS_OFFSET,
#: uniform on 1, …, 2⁵³ (:func:`radii`; ``workers.dp.normal`` forms the same in torch)
RADIUS_SHIFT, RADIUS_OFFSET, RADIUS_UNIT = 11, 2**52 + 1, 2.0**-53
#: the bits of an angle's k by the width of its words in bytes (:func:`angles`): a float32
#: significand from 32-bit words, a float64 one from 64-bit words
ANGLE_BITS = {4: 24, 8: 53}


def keystream_bytes(size: int, itemsize: int) -> int:
    """The keystream bytes a draw of ``size`` normals of ``itemsize`` bytes takes."""
    pairs = size // (2 * CHUNK) * CHUNK + (size % (2 * CHUNK) + 1) // 2
    return (8 + itemsize) * pairs


def claim(keystream: Keystream, flat: np.ndarray) -> list[Chunk]:
    """Claim the keystream bytes of a draw into ``flat``, at once; the draw's chunks."""
    at = keystream.claim(keystream_bytes(len(flat), flat.itemsize))
    return plan(len(flat), flat.itemsize, at)


def plan(size: int, itemsize: int, at: int) -> list[Chunk]:
    """The chunks of a draw of ``size`` normals of ``itemsize`` bytes whose keystream bytes
    start at byte ``at`` (:func:`keystream_bytes` of them, claimed at once)."""
    chunks = []
    for start in range(0, size, 2 * CHUNK):
        stop = min(start + 2 * CHUNK, size)
        half = (stop - start + 1) // 2  # pairs: an odd tail drops its last sine
        chunks.append((start, stop, at))
        at += (8 + itemsize) * half
    return chunks


def make(
    keystream: Keystream,
    flat: np.ndarray,
    chunk: Chunk,
    piece: int = CHUNK,
    scale: float = 1.0,
) -> None:
    """Write ``chunk``'s normals, times ``scale``, into the flat float32 or float64 array
    ``flat``, ``piece`` pairs at a time (the same bits whatever the pieces: the radii's words
    and the angles' are each read on from their place by a reader of their own, one cipher
    context each for the chunk). The radii are formed in ``flat`` itself, the sines too, and
    the cosines overwrite the angles; one buffer holds a piece's radii's words, then its
    angles' words and the angles: 8 bytes a pair for float32 noise, 16 for float64. Smaller
    pieces hold less and cost more calls (the child, whose time is hidden, takes ``PIECE``).
    The scale multiplies the radii, half the values, so that no pass over the
    whole output is left to the caller (the engine's σ_T)."""
    start, stop, at = chunk
    part = flat[start:stop]
    half, size = (len(part) + 1) // 2, flat.itemsize
    radius, sine = part[:half], part[half:]
    radii_words, angle_words = keystream.reader(at), keystream.reader(at + 8 * half)
    held = buffer(max(8, 2 * size) * min(piece, half))
    for first in range(0, half, piece):
        n = min(piece, half - first)
        r, s = radius[first : first + n], sine[first : first + n]
        radii(radii_words.read(8 * n, held).view(np.int64), out=r)
        if scale != 1.0:
            r *= scale
        words = angle_words.read(size * n, held).view(f"i{size}")
        angle = angles(words, out=held[size * n : 2 * size * n].view(flat.dtype))
        np.multiply(np.sin(angle[: len(s)], out=s), r[: len(s)], out=s)
        np.multiply(r, np.cos(angle, out=angle), out=r)


def draw(keystream: Keystream, flat: np.ndarray, scale: float = 1.0, piece: int = CHUNK) -> None:
    """Fill the flat float32 or float64 array ``flat`` with normals of standard deviation
    ``scale``: the stream's next draw (:func:`claim`), chunk after chunk."""
    for chunk in claim(keystream, flat):
        make(keystream, flat, chunk, piece, scale)


def radii(words: np.ndarray, *, out: np.ndarray) -> np.ndarray:
    """Box–Muller radii r = √(−2 ln v) from 64-bit keystream words (overwritten), into ``out``
    (float32 or float64).

    v = m·2⁻⁵³ with m = (w >> 11) + 2⁵² + 1, uniform on 1, …, 2⁵³: 53 bits, v in (0, 1]
    exactly, so the tail reaches √(−2 ln 2⁻⁵³) ≈ 8.57σ (a 32-bit v would cut it at 6.66σ: see
    ``workers.dp.randomness``). v is rounded to ``out``'s dtype once, as m converts (float32:
    by at most 2⁻²⁴ relative, moving r by about 10⁻⁷ relative; the smallest v, 2⁻⁵³, is exact;
    the scaling by a power of two is exact), and its logarithm taken in that dtype, half
    float64's cost in float32."""
    m = np.right_shift(words, RADIUS_SHIFT, out=words)
    m += RADIUS_OFFSET
    np.copyto(out, m, casting="unsafe")
    out *= RADIUS_UNIT
    np.log(out, out=out)
    out *= -2.0
    return np.sqrt(out, out=out)


def angles(words: np.ndarray, *, out: np.ndarray) -> np.ndarray:
    """Box–Muller angles θ = 2π·k·2⁻ᵇ in [−π, π) from keystream words (overwritten), into
    ``out`` (float32 or float64, the words' width), k their top b bits as a signed integer,
    uniform on −2ᵇ⁻¹, …, 2ᵇ⁻¹ − 1: in float32 with b = 24 from 32-bit words (a float32
    significand, so k is exact in float32), in float64 with b = 53 from 64-bit ones."""
    bits = ANGLE_BITS[words.itemsize]
    k = np.right_shift(words, 8 * words.itemsize - bits, out=words)
    np.copyto(out, k, casting="unsafe")
    out *= 2 * math.pi * 2.0**-bits
    return out


def serve(fd: int, size: int, dtype: str) -> None:
    """The child: draw into the ``size`` values of ``dtype`` in the shared file ``fd`` from a
    keystream under a key of its own, freshly made here, that never leaves this process. It
    writes ``READY`` once started, then for each line on stdin (a standard deviation) the
    stream's next draw and ``MADE`` (``FAILED`` and its error on stderr if the draw failed);
    it exits when stdin closes (the trial dropped the buffer) or stdout does."""
    flat = np.frombuffer(mmap.mmap(fd, size * np.dtype(dtype).itemsize), dtype=dtype)
    keystream, replies = Keystream(), sys.stdout.buffer
    try:
        replies.write(READY)
        replies.flush()
        for line in sys.stdin:
            try:
                draw(keystream, flat, float(line), PIECE)
                reply = MADE
            except Exception:  # the parent raises where it needs the noise
                traceback.print_exc()
                reply = FAILED
            replies.write(reply)
            replies.flush()
    except BrokenPipeError:  # the parent is gone
        return
