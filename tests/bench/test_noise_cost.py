"""``bench/noise_cost.py`` times the product's Gaussian noise, its stages and the other secure
generators side by side; a tiny instance, and its transform stage checked against the product."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from randomgen import AESCounter

from workers.dp import randomness
from workers.dp.randomness import CHUNK, SecureStream


def test_every_row_is_timed_and_shown_as_a_ratio_to_the_product(bench, capsys) -> None:
    results = bench("noise_cost").main(["--sizes", "1001", "--repeats", "1"])
    seconds = results[1001]
    assert set(seconds) >= {"product", "aes_uniforms", "transform", "chacha20_uniforms"}
    assert all(value > 0 for value in seconds.values())
    out = capsys.readouterr().out
    assert "| product |" in out and "| 1.00× |" in out


@pytest.mark.parametrize("n", [1, 2, 7, 2 * CHUNK + 3])
def test_the_transform_row_runs_the_products_code_on_the_same_uniforms(
    bench, monkeypatch, n: int
) -> None:
    """Keyed alike, the ``transform`` row's stream (uniforms drawn beforehand) gives the product's
    draws bit for bit: an odd count and more than one chunk included."""
    keyed = lambda: np.random.Generator(AESCounter(key=2024))  # noqa: E731
    monkeypatch.setattr(randomness, "secure_generator", keyed)
    given = bench("noise_cost")._Given(n)
    assert torch.equal(given.normal(n), SecureStream().normal(n))
