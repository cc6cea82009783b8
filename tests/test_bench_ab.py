"""The A/B core's reading of paired rounds (:meth:`stepgraph.bench.ab.Compared.change_from`),
on hand-made round times (CPU)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from stepgraph.bench.ab import Compared


def test_the_change_pairs_round_with_round() -> None:
    base = Compared(0.0, [3847.2, 3847.3, 3846.7])
    tried = Compared(7.9e-6, [3813.8, 3814.5, 3814.4])
    low, high = tried.change_from(base)
    assert low == pytest.approx(-33.4)
    assert high == pytest.approx(-32.3)


def test_drift_shared_by_a_pair_does_not_widen_the_change() -> None:
    # the machine slows 20 us between rounds; B stays 5 us behind A in each
    base = Compared(0.0, [100.0, 120.0, 140.0])
    tried = Compared(0.0, [105.0, 125.0, 145.0])
    assert tried.change_from(base) == pytest.approx((5.0, 5.0))


def test_rounds_that_do_not_pair_are_refused() -> None:
    with pytest.raises(ValueError, match="paired rounds: 2 against 3"):
        Compared(0.0, [1.0, 2.0]).change_from(Compared(0.0, [1.0, 2.0, 3.0]))
