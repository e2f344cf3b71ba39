"""
What stops a run before max_steps: stop signals, optimizer steps skipped in a row, divergence.

    signals = catch_stop_signals(notice)    # the first SIGINT/SIGTERM is noted and answered: the loop saves, stops
    guard = Guard(z, max_skipped, state)    # after a step: guard.update(loss, norm, applied) -> stop?
    raise Diverged(f"...; {remedy(cfg)}")   # one line, exit code 3

Imports nothing of the project.
"""
import math
import os
import signal
from collections import deque

OUTLIER_WINDOW = 128  # steps of history for the outlier test (llm.c's window)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Diverged(Exception):
    """The run cannot go on (steps skipped in a row, non-finite weights): one line, exit code 3."""


class Stopped(KeyboardInterrupt):
    """A second SIGINT/SIGTERM: quit now, without saving."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


def remedy(cfg):
    """What to try after a divergence, for this config."""
    clip = "lower grad_clip (e.g. 0.5)" if cfg.grad_clip > 0 else "set grad_clip=1.0"
    return f"lower max_lr{' and muon_lr' if cfg.optimizer == 'muon' else ''} or {clip} and start again"


def catch_stop_signals(notice=None):
    """From here on, the first SIGINT/SIGTERM is noted in the returned list (the loop stops after the
    current optimizer step, or an evaluation at its next batch, and saves) and answered at once with the
    line notice(signum) returns (None: nothing said); a second one raises Stopped wherever the loop is (a
    save in progress leaves its .tmp, never a broken file under a checkpoint's name). The loop ignores
    both once its last checkpoint is written; main() puts the previous handlers back. The line goes
    straight to stderr's file descriptor: a print inside a handler can collide with one in progress."""
    got = []

    def handler(signum, frame):
        if got:
            raise Stopped(signum)
        got.append(signum)
        line = notice(signum) if notice else None
        if line:
            try:
                os.write(2, (line + "\n").encode())
            except OSError:
                pass
    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)
    return got


class Guard:
    """Counts optimizer steps skipped in a row (inf/nan loss or gradients, or outliers) and stops the
    run after max_skipped of them. With z > 0 it flags as an outlier a step whose loss or gradient norm
    is more than z standard deviations above its mean over the last OUTLIER_WINDOW steps (the test
    starts once the window is full; every finite step goes into it, llm.c-style, so a lasting shift
    is absorbed). Its state is saved in checkpoints: a resumed run skips the same steps."""

    def __init__(self, z, max_skipped, state=None):
        self.z, self.max_skipped = z, max_skipped
        state = state or {}
        self.history = {k: deque(state.get(k, []), maxlen=OUTLIER_WINDOW) for k in ("loss", "norm")}
        self.in_a_row = state.get("in_a_row", 0)

    def is_outlier(self, loss, norm):
        return self.z > 0 and any(zscore(self.history[k], v) > self.z for k, v in (("loss", loss), ("norm", norm)))

    def update(self, loss, norm, applied):
        """After a step: True when it was the max_skipped-th skipped in a row."""
        if math.isfinite(loss) and math.isfinite(norm):
            self.history["loss"].append(loss)
            self.history["norm"].append(norm)
        self.in_a_row = 0 if applied else self.in_a_row + 1
        return 0 < self.max_skipped <= self.in_a_row

    def state_dict(self):
        return {"loss": list(self.history["loss"]), "norm": list(self.history["norm"]), "in_a_row": self.in_a_row}


def zscore(window, x):
    """How many standard deviations x is above the window's mean; 0 until the window is full."""
    if len(window) < window.maxlen:
        return 0.0
    mean = sum(window) / len(window)
    std = math.sqrt(sum((v - mean) ** 2 for v in window) / len(window))
    return (x - mean) / std if std > 0 else 0.0
