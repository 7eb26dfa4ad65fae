"""Errors that decide how the command line reports a failure."""

from __future__ import annotations


class ResumableFailure(RuntimeError):
    """A job failed in a way the newest complete checkpoint recovers from (e.g. a learner rank died): the
    command line says to rerun with ``--resume`` instead of printing a traceback."""
