"""
What stops a run before max_steps: stop signals, the time limit, optimizer steps skipped in a row,
divergence; and the lines that say so.

    signals = catch_stop_signals(notice)  # the first SIGINT/SIGTERM: noted, answered, then a save
    asks = stop_asks(signals, progress, minutes)  # this rank's Asks after a step (Asks.read: all's)
    guard = Guard(z, max_skipped, state)  # after a step: guard.update(loss, norm, applied) -> stop?
    raise Diverged(f"...; {remedy(cfg)}")  # one line, exit code 3

Imports nothing of the project.
"""
import math
import os
import signal
import time
from collections import deque
from typing import NamedTuple

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
    muon = " and muon_lr" if cfg.optimizer == "muon" else ""
    return f"lower max_lr{muon} or {clip} and start again"


def catch_stop_signals(notice=None):
    """From here on, the first SIGINT/SIGTERM is noted in the returned list (the loop stops after
    the current optimizer step, or an evaluation at its next batch, and saves) and answered at once
    with the line notice(signum) returns (None: nothing said); a second one raises Stopped wherever
    the loop is (a save in progress leaves its .tmp, never a broken file under a checkpoint's name).
    The loop ignores both once its last checkpoint is written; main() puts the previous handlers
    back. The line goes straight to stderr's file descriptor: a print inside a handler can collide
    with one in progress."""
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
    """Counts optimizer steps skipped in a row (inf/nan loss or gradients, or outliers) and stops
    the run after max_skipped of them. With z > 0 it flags as an outlier a step whose loss or
    gradient norm is more than z standard deviations above its mean over the last OUTLIER_WINDOW
    steps (the test starts once the window is full; every finite step goes into it, llm.c-style, so
    a lasting shift is absorbed). Its state is saved in checkpoints: a resumed run skips the same
    steps."""

    def __init__(self, z, max_skipped, state=None):
        self.z, self.max_skipped = z, max_skipped
        state = state or {}
        self.history = {k: deque(state.get(k, []), maxlen=OUTLIER_WINDOW) for k in ("loss", "norm")}
        self.in_a_row = state.get("in_a_row", 0)

    def is_outlier(self, loss, norm):
        pairs = (("loss", loss), ("norm", norm))
        return self.z > 0 and any(zscore(self.history[k], v) > self.z for k, v in pairs)

    def update(self, loss, norm, applied):
        """After a step: True when it was the max_skipped-th skipped in a row."""
        if math.isfinite(loss) and math.isfinite(norm):
            self.history["loss"].append(loss)
            self.history["norm"].append(norm)
        self.in_a_row = 0 if applied else self.in_a_row + 1
        return 0 < self.max_skipped <= self.in_a_row

    def state_dict(self):
        return {"loss": list(self.history["loss"]), "norm": list(self.history["norm"]),
                "in_a_row": self.in_a_row}

    def diverged(self, why, step, newest, cfg):
        """The Diverged that stops a run after max_skipped steps skipped in a row (the last at step,
        for why), naming the newest checkpoint and what to try."""
        return Diverged(f"the run diverged: {self.in_a_row} optimizer steps in a row were skipped "
                        f"({why}), the last at step {step} (newest checkpoint: "
                        f"{newest or 'none'}); {remedy(cfg)}")


def zscore(window, x):
    """How many standard deviations x is above the window's mean; 0 until the window is full."""
    if len(window) < window.maxlen:
        return 0.0
    mean = sum(window) / len(window)
    std = math.sqrt(sum((v - mean) ** 2 for v in window) / len(window))
    return (x - mean) / std if std > 0 else 0.0


# -----------------------------------------------------------------------------
# a stop before max_steps: what the ranks ask for after a step, and the lines that say it


class Asks(NamedTuple):
    """What a rank asks for after an optimizer step (stop_asks), or what any rank asked for
    (read)."""
    signals: tuple  # one per STOP_SIGNALS: caught?
    out_of_time: bool  # too little time left for a step and a save (time_limit)
    clock_due: bool  # a save by the clock (checkpoint_minutes) is due

    def flags(self):
        """The asks as numbers, in order: what distributed.over_ranks sums over the ranks."""
        return [float(ask) for ask in (*self.signals, self.out_of_time, self.clock_due)]

    @classmethod
    def read(cls, counts):
        """The Asks of the ranks together from how many ranks asked for each (over_ranks' sums)."""
        *signals, out_of_time, clock_due = [n > 0 for n in counts]
        return cls(tuple(signals), out_of_time, clock_due)

    @property
    def signal(self):
        """The first stop signal asked for, or None."""
        return next((sig for sig, ask in zip(STOP_SIGNALS, self.signals) if ask), None)


def stop_asks(signals, progress, checkpoint_minutes):
    """This rank's Asks after a step: a stop signal caught, out of time (too little left for the
    longest iteration, a step and a save before progress.deadline), a save by the clock due."""
    now = time.time()
    out_of_time = now + progress.longest + progress.step_s + progress.save_s > progress.deadline
    clock_due = checkpoint_minutes > 0 and now - progress.saved_at > checkpoint_minutes * 60
    return Asks(tuple(sig in signals for sig in STOP_SIGNALS), out_of_time, clock_due)


def stop_notice(progress, sig, ddp=False):
    """The line the first SIGINT/SIGTERM is answered with at once (the signal handler writes it):
    what the run does now, and what a second signal costs. ddp: under torchrun the save needs every
    rank (a peer killed with this rank, torchrun's SIGTERM, leaves no save: say so)."""
    name, step, lost = signal.Signals(sig).name, progress.at, progress.at - progress.saved_step
    ranks = " if every rank answers" if ddp else ""
    if progress.phase == "end":
        now, lost = f"the final evaluation stops at its next batch (step {step} is saved)", 0
    elif progress.phase == "eval":
        now = f"the evaluation stops at its next batch, then step {step} is saved{ranks}"
    else:
        now, lost = f"finishing step {step}, then step {step + 1} is saved{ranks}", lost + 1
    again = "Ctrl-C" if sig == signal.SIGINT else name
    return (f"{name}: stopping: {now}; {again} again quits at once" +
            (f" without saving the last {lost} step(s)" if lost > 0 else ""))


def stopped_line(sig, time_limit, step, in_eval, path, command):
    """The line a stop before max_steps ends with (sig, or None: time_limit minutes): after step - 1
    or in the evaluation at step, what was saved (path) and the command that continues."""
    reason = signal.Signals(sig).name if sig else f"time_limit={time_limit:g} min"
    if not path:
        return (f"{reason}: stopped in the evaluation at step {step}: nothing trained yet, "
                "nothing saved")
    where = f" (in the evaluation at step {step})" if in_eval else ""
    return f"{reason}: stopped after step {step - 1}{where}, saved {path}; resume with: {command}"


def end_stopped_line(sig, newest):
    """The line for a signal that stopped the final evaluation (the run is saved, in newest)."""
    return (f"{signal.Signals(sig).name}: the final evaluation stopped (not logged); the run is "
            f"saved{_in(newest)}")


def end_failed_line(what, e, newest):
    """The warning for optional end-of-run work (what) that raised e: the run is saved all the
    same."""
    return (f"warning: {what} failed ({type(e).__name__}: {str(e).strip()[:200]}); the run itself "
            f"is saved{_in(newest)}")


def _in(newest):
    return f" in {newest}" if newest else ""


def interrupted_line(signum):
    """The line for a stop before training began, or a second one while stopping: nothing saved."""
    return (f"{signal.Signals(signum).name}: stopped at once, nothing saved (the checkpoints in "
            "out_dir are as they were)")
