"""Errors that decide how the command line reports a failure."""

from __future__ import annotations


class ResumableFailure(RuntimeError):
    """A job failed in a way the newest complete checkpoint recovers from (e.g. a learner rank died): the
    command line says to rerun with ``--resume`` instead of printing a traceback."""

    checkpoint: str | None = None
    """The newest complete checkpoint the failed job left, when the job that raised it knows (None: none yet, or
    not known)."""
    checked: bool = False
    """Whether ``checkpoint`` was looked for (so that None means none was written)."""


class UnitError(ValueError):
    """A unit of one's own (an RL algorithm) gave the learner what it cannot use (advantages of another shape, or
    not finite): code to fix, which a resume would repeat. Raised in a learner rank, it reaches the command line
    as itself (one line), not as a failed rank to resume."""
