"""The seed tutorial's terminal loop: show a prompt and a sampled result, ask for a reward, store it.

    [Step 1]  item 3 · result 1 of 4 · done 2, left 18
    prompt>>> 12 7 33
    result>>> 4 5 9
    Reward (-2.0 ~ 2.0): 1.5

Each answer is stored at once, in its own transaction (a ``rate`` submission of one candidate, merged into
the annotator's rating of the item), in the same database as the web app. A bad answer (not a number, out of
range) is asked again with the range named. Ctrl-C, Ctrl-D or ``q`` stop the loop: every answer already
entered is kept (Ctrl-C while an answer is being stored waits for it), and the next run resumes with the
first unrated result.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from rlt2t.services.annotation.store import Annotator, Store, Submission, display_order


@dataclass(frozen=True, slots=True)
class TerminalResult:
    rated: int
    """Ratings stored in this run."""
    finished: bool
    """The queue is empty."""


class _Stop(Exception):
    """The annotator asked to stop (q, end of input)."""


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Hold Ctrl-C while a rating is stored (main thread only), then deliver it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


def ask_reward(low: float, high: float, read: Callable[[str], str], write: Callable[[str], None]) -> float:
    """Ask until the answer is a number in [low, high]; raises _Stop on `q` or end of input."""
    prompt = f"Reward ({float(low)} ~ {float(high)}): "
    while True:
        try:
            answer = read(prompt).strip()
        except EOFError:
            raise _Stop from None
        if answer.lower() in ("q", "quit", "exit"):
            raise _Stop
        try:
            value = float(answer)
        except ValueError:
            value = math.nan
        if math.isfinite(value) and low <= value <= high:
            return value
        write(f"please enter a number from {float(low)} to {float(high)} (q to stop)")


def run_terminal(store: Store, annotator: Annotator, *, rating_range: tuple[float, float], shuffle: bool = True,
                 max_per_item: int = 0, limit: int | None = None, read: Callable[[str], str] = input,
                 write: Callable[[str], None] = print) -> TerminalResult:
    """Rate the results of ``annotator``'s queue one by one until it is empty, ``limit`` ratings, or a stop."""
    low, high = rating_range
    rated = step = 0
    try:
        while limit is None or rated < limit:
            item = store.next_item(annotator, max_per_item)
            if item is None:
                write("nothing left to rate")
                return TerminalResult(rated, finished=True)
            mine = store.annotation_of(annotator, item.id)
            done = set(mine.ratings) if mine is not None and mine.status == "partial" else set()
            shown = display_order(item, annotator.id, shuffle)
            todo = [(k, c) for k, c in enumerate(shown, start=1) if c.id not in done]
            if not todo:  # cannot happen: a fully rated item is `rated`, out of the queue
                raise RuntimeError(f"item {item.id} is in the queue with every result rated")
            for k, candidate in todo:
                if limit is not None and rated >= limit:
                    break
                step += 1
                progress = store.progress(annotator, max_per_item)
                write(f"[Step {step}]  item {item.id} · result {k} of {len(shown)} · done {progress.done}, "
                      f"left {progress.left}")
                write(f"prompt>>> {item.source}")
                write(f"result>>> {candidate.text}")
                value = ask_reward(low, high, read, write)
                with _sigint_deferred():
                    store.submit(annotator, Submission(submission_id=uuid.uuid4().hex, item_id=item.id,
                                                       action="rate", ratings={candidate.id: value}))
                rated += 1
        return TerminalResult(rated, finished=False)
    except (_Stop, KeyboardInterrupt):
        write("")
        return TerminalResult(rated, finished=False)
