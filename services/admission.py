"""How long work takes on this server: the service-time model behind admission and fair sharing.

A request's items each carry a :class:`Work`, the features of what they ask of the model: decoding ``steps``
(sequential, paid once per call whatever its size), ``rows`` (row-steps: every row decoded at every step),
``context`` (the positions those row-steps attend to: source plus the tokens so far) and ``prefill`` (what
each row pays once for its source: the encoder, the cross-attention keys and values). The policy server's
sampling is about linear in these four: a step's fixed overhead, the feed-forward and projection work of each
row, the attention over a row's context (what makes 255 new tokens after a 255-token source cost far more than
after a 24-token one), and the source's one-off work (a large share of a short call, little of a long one).

:class:`ServiceTime` turns a call's work into seconds: ``scale x (per_step·steps + per_row·rows +
per_context·context + per_prefill·prefill)``. The coefficients are *calibrated* at start-up, by a
non-negative least-squares fit over a few calls of chosen shapes run on the worker before any request (see the
apps' ``calibration``), and the
scale is *updated from served calls*: the ratio of measured to modelled seconds over the last minute,
weighted by time, so a machine that gets busier (other processes on its cores) predicts slower at once.
Without a calibration the model is proportional to ``rows`` (the scale learned from the first calls on).

:class:`RecentCalls` remembers what the worker spent its time on lately; a long request shares the worker
with the small ones that run inside its calls (``rlt2t.services.batching``), and the share they took lately
is the share it should expect to lose.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np

SAFETY = 1.2
"""Predictions are the model's seconds times this: room for its error, so that what is admitted finishes."""
SCALE_HALF_LIFE_S = 60.0
"""Served calls older than this count half as much in the scale (measured / modelled seconds)."""


Features: TypeAlias = tuple[float, float, float, float]


@dataclass(frozen=True)
class Work:
    """What an item (or a call) asks of the model: the features of the service-time model."""

    steps: int = 1
    """Sequential steps (decoding steps; 1 for a single forward pass or a metric call). A call takes the
    most steps of its items, not their sum."""
    rows: float = 0.0
    """Row-steps: each decoded row counted once per step it runs (metrics: their work units)."""
    context: float = 0.0
    """Positions attended over those row-steps (source tokens plus the tokens decoded so far)."""
    prefill: float = 0.0
    """Source positions of the rows, paid once per row (the encoder, the cross-attention keys and values)."""

    def __add__(self, other: Work) -> Work:
        return Work(max(self.steps, other.steps), self.rows + other.rows, self.context + other.context,
                    self.prefill + other.prefill)

    def features(self, calls: int = 1) -> Features:
        """(steps paid, rows, context, prefill) when the work runs as ``calls`` calls (each pays its steps)."""
        return (float(self.steps * calls), self.rows, self.context, self.prefill)


def total(works: Iterable[Work]) -> Work:
    """One call's work: the most steps of its items, the sum of their rows and context."""
    out = Work(steps=0)
    for w in works:
        out = out + w
    return out


def sampled_work(rows: int, source_tokens: int, new_tokens: int) -> Work:
    """``rows`` rows each decoding ``new_tokens`` tokens after a source of ``source_tokens``: its context
    grows from the source to source + new tokens, ``source + new / 2`` on average."""
    return Work(steps=new_tokens, rows=float(rows * new_tokens),
                context=float(rows * new_tokens * (source_tokens + new_tokens / 2)),
                prefill=float(rows * source_tokens))


def _nonnegative_least_squares(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin |x·θ - y| over θ >= 0, for the few columns here: the best of the least-squares fits on every
    subset of columns whose coefficients all come out non-negative (exact NNLS, 15 fits for 4 columns)."""
    n = x.shape[1]
    best, best_err = np.zeros(n), float(np.sum(y**2))
    for size in range(1, n + 1):
        for cols in itertools.combinations(range(n), size):
            theta, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
            if np.any(theta < 0):
                continue
            full = np.zeros(n)
            full[list(cols)] = theta
            err = float(np.sum((x @ full - y) ** 2))
            if err < best_err:
                best, best_err = full, err
    return best


def _dot(coef: Features, features: Features) -> float:
    return sum(c * f for c, f in zip(coef, features, strict=True))


class ServiceTime:
    """Seconds a call of some :class:`Work` takes on this server; see the module docstring. Thread-safe: the
    worker observes, the event loop predicts."""

    def __init__(self, *, half_life_s: float = SCALE_HALF_LIFE_S) -> None:
        self._lock = threading.Lock()
        self._coef: Features = (0.0, 1.0, 0.0, 0.0)  # uncalibrated: proportional to rows
        self._half_life_s = half_life_s
        self._measured = 0.0  # time-decayed sums of measured and modelled seconds
        self._modelled = 0.0
        self._at = time.monotonic()
        self.calibrated = False
        """True once :meth:`calibrate` fitted the coefficients."""

    @property
    def coefficients(self) -> Features:
        """Seconds per step, per row-step, per attended position and per source position, before the scale."""
        with self._lock:
            return self._coef

    @property
    def scale(self) -> float:
        """Measured / modelled seconds of the recent calls (1 before any)."""
        with self._lock:
            return self._measured / self._modelled if self._modelled > 0 else 1.0

    @property
    def ready(self) -> bool:
        """True when predictions mean something: calibrated, or some call observed."""
        with self._lock:
            return self.calibrated or self._modelled > 0

    def calibrate(self, samples: Sequence[tuple[Work, float]]) -> None:
        """Fit the coefficients to ``(work, seconds)`` of calls of varied shapes (four or more; fewer keep
        the rows-proportional model), and restart the scale from them."""
        if len(samples) < 4:
            for work, seconds in samples:
                self.observe(work, seconds)
            return
        x = np.array([w.features() for w, _ in samples], dtype=np.float64)
        y = np.array([s for _, s in samples], dtype=np.float64)
        # Relative errors: every shape counts alike, not just the longest call (each row divided by its seconds).
        weight = 1.0 / np.maximum(y, 1e-6)
        x, y = x * weight[:, None], y * weight
        norm = np.maximum(x.max(axis=0), 1e-12)  # columns of similar size: lstsq conditions better
        coef = _nonnegative_least_squares(x / norm, y) / norm
        if not np.any(coef > 0):
            return
        with self._lock:
            self._coef = (float(coef[0]), float(coef[1]), float(coef[2]), float(coef[3]))
            self.calibrated = True
            self._measured = self._modelled = 0.0
        for work, seconds in samples:
            self.observe(work, seconds)

    def fork(self) -> ServiceTime:
        """A model of its own for another kind of call (another metric on the reward server): this one's
        coefficients, and its scale until the first call of that kind, whose measure then replaces it (the scale is
        carried with the weight of a microsecond of calls: a reward model thirty times slower than the calibration
        says is predicted so from its first call on)."""
        out = ServiceTime(half_life_s=self._half_life_s)
        with self._lock:
            out._coef, out.calibrated, out._at = self._coef, self.calibrated, self._at
            if self._modelled > 0:
                out._modelled = 1e-6
                out._measured = 1e-6 * self._measured / self._modelled
        return out

    def observe(self, work: Work, seconds: float) -> None:
        """A served call of ``work`` took ``seconds`` (its own: not the calls run inside it)."""
        if not (seconds >= 0 and math.isfinite(seconds)):
            return
        with self._lock:
            modelled = _dot(self._coef, work.features())
            if modelled <= 0:
                return
            now = time.monotonic()
            decay = 0.5 ** ((now - self._at) / self._half_life_s)
            self._at = now
            self._measured = self._measured * decay + seconds
            self._modelled = self._modelled * decay + modelled

    def seconds(self, work: Work, calls: int = 1) -> float:
        """Predicted seconds of ``work`` run as ``calls`` calls (SAFETY included; 0 before :attr:`ready`)."""
        with self._lock:
            if not self._modelled:
                return 0.0
            scale = self._measured / self._modelled
            return SAFETY * scale * _dot(self._coef, work.features(calls))


class RecentCalls:
    """The worker's calls of the last ``window_s`` seconds: their duration and the cost of the largest request
    in each. ``share_below(cost)``: the fraction of that window spent on calls of requests costing at most
    ``cost`` (the small requests that would run inside a longer one's calls)."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._calls: deque[tuple[float, float, int]] = deque()  # (ended, seconds, largest request cost)
        self._lock = threading.Lock()

    def record(self, seconds: float, largest_cost: int, ended: float | None = None) -> None:
        with self._lock:
            self._calls.append((time.monotonic() if ended is None else ended, seconds, largest_cost))
            self._forget(time.monotonic())

    def _forget(self, now: float) -> None:
        while self._calls and self._calls[0][0] < now - self.window_s:
            self._calls.popleft()

    def share_below(self, cost: int, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._forget(now)
            busy = sum(min(s, self.window_s) for ended, s, largest in self._calls
                       if largest <= cost and ended >= now - self.window_s)
        return min(1.0, busy / self.window_s)
