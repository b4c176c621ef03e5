"""Spike detection on a hand sequence, the divergence rule and the stable learning-rate range."""

from __future__ import annotations

import math

from qklab.diagnostics import SpikeDetector, diverged, find_spikes, stability_summary


def _noisy(n: int, base: float = 3.0) -> list[float]:
    return [base + (0.01 if i % 2 else -0.01) for i in range(n)]  # mean 3.0, std 0.01


def test_spike_detector_on_a_hand_sequence():
    losses = _noisy(40)
    losses[30] = 3.0 + 0.061  # 6.1 sigma above a window of mean 3.0, std 0.01: a spike
    losses[35] = 3.0 + 0.055  # 5.5 sigma: not one
    assert find_spikes(enumerate(losses, start=1)) == [31]


def test_spike_needs_history_and_ignores_nonfinite():
    det = SpikeDetector(window=128, sigma=6.0, min_history=16)
    for v in _noisy(15):
        assert det.update(v) is None
    assert det.update(100.0) is None  # only 15 losses in the window: no verdict yet
    det = SpikeDetector()
    for v in _noisy(20):
        det.update(v)
    assert det.update(float("nan")) is None
    hit = det.update(5.0)
    assert hit is not None and hit["sigmas"] > 6 and math.isclose(hit["window_mean"], 3.0, abs_tol=1e-9)


def test_window_is_rolling_and_state_round_trips():
    det = SpikeDetector(window=4, sigma=6.0, min_history=4)
    for v in [10.0, 10.0, 1.0, 1.01, 0.99, 1.0]:  # the two 10s leave the window
        det.update(v)
    copy = SpikeDetector(window=4, sigma=6.0, min_history=4)
    copy.load_state_dict(det.state_dict())
    assert det.update(1.5) is not None and copy.update(1.5) is not None


def test_diverged_rule_and_summary():
    ok = [{"step": 1, "loss": 8.0}, {"step": 2, "loss": 5.0}]
    assert not diverged(ok)
    assert diverged([{"step": 1, "loss": 8.0}, {"step": 2, "loss": "nan"}])
    assert diverged([{"step": 1, "loss": 8.0}, {"step": 2, "loss": 8.5}])
    recs = [*ok, {"step": 3, "event": "nonfinite_skip", "loss": "inf"}, {"step": 4, "loss": 4.0}]
    assert diverged(recs)
    s = stability_summary(recs + [{"step": 4, "event": "loss_spike", "loss": 4.0}])
    assert s == {"diverged": True, "spikes": [4], "nonfinite_steps": [3]}
