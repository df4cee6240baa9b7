"""``bench/noise_cost.py`` times the product's Gaussian noise, its stages and the other secure
generators side by side; a tiny instance, and its transform stage checked against the product."""

from __future__ import annotations

import pytest
import torch

from core.entropy import Keystream
from workers.dp import randomness
from workers.dp.randomness import SecureStream
from workers.gaussian import CHUNK, keystream_bytes


def test_every_row_is_timed_and_shown_as_a_ratio_to_the_product(bench, capsys) -> None:
    results = bench("noise_cost").main(["--sizes", "1001", "--repeats", "1"])
    seconds = results[1001]
    assert set(seconds) >= {"product", "keystream", "transform", "randomgen_aes", "chacha20"}
    assert all(value > 0 for value in seconds.values())
    out = capsys.readouterr().out
    assert "| product |" in out and "| 1.00× |" in out


@pytest.mark.parametrize("n", [1, 2, 7, 2 * CHUNK + 3])
def test_the_transform_row_runs_the_products_code_on_the_same_uniforms(
    bench, monkeypatch, n: int
) -> None:
    """Keyed alike, the ``transform`` row's stream (bytes drawn beforehand) gives the product's
    draws bit for bit, twice: an odd count and more than one chunk included."""
    key = bytes(16)
    monkeypatch.setattr(randomness, "Keystream", lambda: Keystream(key))
    given = SecureStream()
    given.keystream = bench("noise_cost")._Given(n, key)
    assert len(given.keystream.drawn) == keystream_bytes(n, 4)  # a step's bytes, drawn before
    expected = SecureStream().normal(n)
    for _ in range(2):  # the bytes are restored for every round
        assert torch.equal(given.normal(n), expected)
