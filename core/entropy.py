"""Random generators that protect privacy, keyed from the operating system's entropy pool.

The one way to make them: a numpy ``Generator`` over AES-128 in counter mode
(``randomgen.AESCounter``) with a fresh 128-bit key from :mod:`secrets` — never a seed that
anyone chose, stored or could see. Why this generator, and how the engine draws from it
(Gaussian noise, Poisson sampling): :mod:`workers.dp.randomness`. It lives here, without torch,
because the tuning job's driver draws from it too (the K of a random-stopping job, the
candidates of a grid or random search) and does not import torch.
"""

from __future__ import annotations

import secrets

import numpy as np
from randomgen import AESCounter


def secure_generator() -> np.random.Generator:
    """An independent generator: AES-128-CTR under a fresh key from OS entropy."""
    return np.random.Generator(AESCounter(key=secrets.randbits(128), counter=0))
