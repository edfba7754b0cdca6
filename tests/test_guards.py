"""train.Guards' spike rule on loss curves: recorded ones (tests/fixtures/losses.json) and the shapes of the
paper's setting, where the loss is near 3 and a step's noise a few hundredths (524,288 tokens per step)."""

import json
import math
import os

import numpy as np
import pytest

from pretrain.guards import Guards
from pretrain.train_config import make_config
from running import REPO

LOSSES = json.load(open(os.path.join(REPO, "tests", "fixtures", "losses.json")))


def guards(**keys):
    return Guards(make_config(**keys), runtime=None, stop_signals=None)


def spikes(losses, **keys):
    """The indices of the losses the default guard calls spikes."""
    guard = guards(**keys)
    return [i for i, loss in enumerate(losses) if guard.is_spike(loss)]


def paper_like_curve(steps, rng, noise=0.03):
    """A power-law fall from ln(50304) towards 2.8, with a step's noise at the paper's batch size."""
    t = np.arange(1, steps + 1)
    return list(2.8 + (math.log(50304) - 2.8) * t ** -0.5 + noise * rng.standard_normal(steps))


def test_a_healthy_run_its_warmup_bump_and_the_paper_settings_noise_are_not_spikes():
    assert spikes(LOSSES["healthy"]) == []  # config/sa_tiny.py: the first steps fall fastest, and noisily
    assert spikes(LOSSES["warmup_bump"]) == []  # up by a nat during warmup, then down again
    assert max(LOSSES["warmup_bump"][:30]) - min(LOSSES["warmup_bump"][:15]) > 1  # the bump is there
    rng = np.random.default_rng(0)
    assert spikes(paper_like_curve(5000, rng)) == []


def test_a_sudden_blow_up_is_caught_at_its_first_step():
    losses = LOSSES["blow_up"]
    first_bad = next(i for i, loss in enumerate(losses) if loss > 100)
    assert spikes(losses) == list(range(first_bad, len(losses)))


def test_a_gradual_divergence_is_caught_which_a_window_mean_absorbs():
    """3 to 7.5 over 300 steps: no step is even 1.5 x the mean of the 50 before it, so the earlier rule (a
    spike is 3 x that mean) never fired; the floor does not climb with the run."""
    rng = np.random.default_rng(1)
    healthy = paper_like_curve(2000, rng)
    floor = min(np.convolve(healthy, np.ones(10) / 10, mode="valid"))
    climb = list(np.linspace(healthy[-1], 7.5, 300) + 0.03 * rng.standard_normal(300))
    losses = healthy + climb
    assert all(loss < 1.5 * np.mean(losses[i - 50:i]) for i, loss in enumerate(losses) if i >= 2000)
    caught = spikes(losses)
    assert caught and caught[0] >= 2000  # none in the healthy part
    threshold = 1.5 * floor + 0.5
    assert losses[caught[0]] > threshold - 0.1 and losses[caught[0] - 5] < threshold + 0.1  # as soon as above it
    assert all(i in caught for i in range(caught[0] + 10, len(losses)))  # and from then on: the run stops


def test_spikes_in_a_row_stop_the_run_and_a_resumed_guard_judges_alike():
    guard = guards(loss_spike_factor=1.5, loss_spike_margin=0.5, loss_spike_steps=2)
    assert [guard.is_spike(x) for x in (10.0, 9.0, 8.0)] == [False] * 3
    threshold = guard.threshold()
    assert guard.floor < 10 and threshold == pytest.approx(1.5 * guard.floor + 0.5)
    assert guard.is_spike(threshold + 1) and not guard.diverged
    assert not guard.is_spike(8.0) and guard.spikes_in_a_row == 0  # recovered; the spike is not averaged in
    assert guard.threshold() == pytest.approx(threshold, rel=0.2)
    resumed = guards(loss_spike_factor=1.5, loss_spike_margin=0.5, loss_spike_steps=2)
    resumed.load_state_dict(guard.state_dict())
    for loss in (30.0, 1e6):
        assert guard.is_spike(loss) == resumed.is_spike(loss) is True
    assert guard.diverged and resumed.diverged


def test_a_guard_of_the_earlier_rule_in_a_checkpoint_carries_on():
    guard = guards()
    guard.load_state_dict({"recent": [3.0, 3.1, 2.9, 3.0], "in_a_row": 0})
    assert guard.threshold() == pytest.approx(1.5 * 3.0 + 0.5)


def test_the_guard_is_off_with_factor_zero_and_spike_steps_must_be_positive():
    assert spikes([1.0, 1.0, 1.0, 1e9, 1e9, 1e9], loss_spike_factor=0) == []
    from configurator import ConfigError
    with pytest.raises(ConfigError, match="loss_spike_steps must be positive, got 0"):
        make_config(loss_spike_steps=0)
