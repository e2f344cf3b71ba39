"""guard.py: the outlier test over its window of recent losses and norms, its state in a checkpoint, and the count of
skipped steps in a row that stops a diverged run. (A skipped step itself: tests/test_optim.py; in a run:
tests/test_survive.py.)

    python -m pytest -q tests/test_guard.py
"""
from gpt2train import guard
from gpt2train.guard import Guard


def test_guard_flags_outliers_once_its_window_is_full():
    g = Guard(z=4.0, max_skipped=3)
    for i in range(guard.OUTLIER_WINDOW - 1):
        assert not g.is_outlier(100.0, 100.0)  # too little history: nothing is an outlier
        assert not g.update(1.0 + 0.01 * (i % 7), 0.5 + 0.01 * (i % 5), applied=True)
    g.update(1.0, 0.5, applied=True)
    assert g.is_outlier(1.5, 0.5) and g.is_outlier(1.0, 5.0)
    assert not g.is_outlier(1.03, 0.52) and not g.is_outlier(-50.0, 0.0)  # only spikes up
    assert not Guard(z=0.0, max_skipped=3, state=g.state_dict()).is_outlier(1.5, 0.5)  # off
    again = Guard(z=4.0, max_skipped=3, state=g.state_dict())
    assert again.state_dict() == g.state_dict() and again.is_outlier(1.5, 0.5)
    assert [g.update(float("nan"), 1.0, applied=False) for _ in range(3)] == [False, False, True]
    assert len(g.history["loss"]) == guard.OUTLIER_WINDOW and not g.update(1.0, 0.5, applied=True)
