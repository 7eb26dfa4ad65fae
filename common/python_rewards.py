"""Rewards written as plain Python functions (``kind: python`` terms, ``rlt2t.train(cfg, reward=fn)``).

A batched function scores every candidate of a call at once; ``per_sample: true`` calls it once per candidate:

    def brevity(sources, candidates, references, **row_fields) -> Sequence[float]:   # one float per candidate
    def brevity(source, candidate, references, **row_fields) -> float:               # per_sample

``references`` holds each candidate's reference list (empty lists where there are none: predict's reranking, a
reward-server request without them); each row field is an extra field of the data row (JSONL keys besides
``id``, ``source``, ``target``, ``references``), one value per candidate (None where a row lacks it). A function
without ``**row_fields`` gets only the fields it names as parameters. The term's ``params`` are passed as
keyword arguments on every call.

What comes back is checked: one real, finite number per candidate, else :class:`RewardError` naming the term,
the candidate and its source, and so is an exception of the function (naming the first source that fails on its
own). A reward is never silently zero.

Functions are found by ``package.module:function`` (imported where the reward is scored: a reward worker, the
reward server) or by the name given to :func:`register_reward`; one given in code travels with the config to the
Ray reward workers (cloudpickle: by value when defined in ``__main__``).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from rlt2t.common.config import ConfigError, PythonTerm
from rlt2t.common.plugins import import_object

RewardFn = Callable[..., Any]
_R = TypeVar("_R", bound=RewardFn)

_REWARDS: dict[str, RewardFn] = {}

# A batched function that raised is called again on its candidates one by one, at most this many, to name the
# first source that fails on its own.
_PROBE_LIMIT = 256


class RewardError(ValueError):
    """A Python reward function raised, or returned something other than one finite number per candidate. Not
    retried: the same candidates fail the same way."""


def register_reward(name: str, *, replace: bool = False) -> Callable[[_R], _R]:
    """Decorator registering a reward function under ``name``, for ``{kind: python, fn: name}`` terms.

        @rlt2t.register_reward("shorter")
        def shorter(sources, candidates, references, **row_fields):
            return [-len(c.split()) for c in candidates]

    Registering a taken name raises ValueError unless ``replace=True``. The registration must run where the
    reward is scored: put it in a module listed in ``reward.plugins`` (a script's own registrations reach the
    Ray reward workers of the jobs it starts through ``rlt2t.train``)."""
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"reward name must be a non-empty str without ':', got {name!r}")

    def decorator(fn: _R) -> _R:
        if not callable(fn):
            raise TypeError(f"register_reward({name!r}) needs a function, got {type(fn).__name__}")
        if name in _REWARDS and _REWARDS[name] is not fn and not replace:
            raise ValueError(f"reward {name!r} is already registered; pass replace=True to override it")
        _REWARDS[name] = fn
        return fn

    return decorator


def registered_rewards() -> dict[str, RewardFn]:
    """Name → function of every reward registered in this process."""
    return dict(_REWARDS)


def resolve_reward_fn(fn: str | RewardFn, where: str) -> RewardFn:
    """The function a term's ``fn`` names (a path or a registered name), or ``fn`` itself; ConfigError naming
    ``where`` when it cannot be found or is not callable."""
    if callable(fn):
        return fn
    if ":" not in fn:
        if fn in _REWARDS:
            return _REWARDS[fn]
        known = ", ".join(sorted(_REWARDS)) or "none"
        raise ConfigError(f"{where}: no reward registered as {fn!r} (registered: {known}); a function elsewhere is "
                          "named `package.module:function`, and a module that registers rewards goes in "
                          "reward.plugins")
    found = import_object(fn, where)
    if not callable(found):
        raise ConfigError(f"{where}: {fn!r} is a {type(found).__name__}, not a function")
    return found


def term_function(term: PythonTerm, where: str) -> RewardFn:
    """The function of a ``python`` term, found (:func:`resolve_reward_fn`) and able to take a reward call's
    arguments (:func:`check_signature`); ConfigError naming ``where`` otherwise."""
    fn = resolve_reward_fn(term.fn, where)
    check_signature(fn, term.per_sample, where)
    return fn


def check_signature(fn: RewardFn, per_sample: bool, where: str) -> None:
    """ConfigError naming ``where`` when ``fn`` cannot be called with the three arguments every reward call passes
    (a signature that cannot be read is left to the call)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind_partial(None, None, None)
    except TypeError:
        name = getattr(fn, "__qualname__", repr(fn))
        expected = ("(source, candidate, references, **row_fields) -> float (per_sample: true)" if per_sample else
                    "(sources, candidates, references, **row_fields) -> one float per candidate")
        raise ConfigError(f"{where}: {name}{signature} cannot take the three arguments a reward is called with: "
                          f"{expected}") from None


def _keywords(fn: RewardFn) -> set[str] | None:
    """The keyword parameters ``fn`` takes besides its first three; None when it takes ``**kwargs`` (or its
    signature cannot be read): then every row field is passed."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params[3:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _raised_at(e: BaseException) -> str:
    """`` at my_rewards.py:12 in brevity `return 1 / n` `` for the line that raised: the error reaches the user as one
    line from a Ray worker, where the traceback is not theirs to read."""
    import traceback

    frames = traceback.extract_tb(e.__traceback__)[1:]  # the first is this module's call
    if not frames:
        return ""
    f = frames[-1]
    code = f" `{f.line.strip()}`" if f.line else ""
    return f" at {Path(f.filename).name}:{f.lineno} in {f.name}{code}"  # the file's name: a server's path stays its own


def _unlabeled(references: Sequence[str], error: BaseException) -> str:
    """What a failure message adds when an index past the end failed on a row without references (RL on sources
    alone, a reranker's pool): ``references[0]`` of an empty list, most likely."""
    return "; its row has no references, an empty list" if not references and isinstance(error, IndexError) else ""


def _short(text: str, limit: int = 120) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


class PythonReward:
    """A :class:`~rlt2t.common.config.PythonTerm` as a reward (see the module docstring)."""

    needs_references = False

    def __init__(self, term: PythonTerm, name: str, where: str = "reward.terms") -> None:
        self.fn = term_function(term, f"{where} ({name})")
        self.name, self.params, self.per_sample = name, dict(term.params), term.per_sample
        self._takes = _keywords(self.fn)

    def _kwargs(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        passed = {k: v for k, v in fields.items() if self._takes is None or k in self._takes}
        if clash := sorted(set(passed) & set(self.params)):
            raise RewardError(f"reward term {self.name}: {', '.join(clash)} is both a row field of the data and a "
                              "param of the term; rename one")
        return {**passed, **self.params}

    def _call(self, sources: Sequence[str], candidates: Sequence[str], references: list[list[str]],
              rows: Sequence[Mapping[str, Any]]) -> Any:
        if self.per_sample:
            out = []
            for i, (s, c, r, row) in enumerate(zip(sources, candidates, references, rows, strict=True)):
                try:
                    out.append(self.fn(s, c, r, **self._kwargs(row)))
                except RewardError:
                    raise
                except Exception as e:
                    raise RewardError(f"reward term {self.name} raised {type(e).__name__}: {e}{_raised_at(e)} "
                                      f"(candidate {i}: {_short(c)}, source {_short(s)}{_unlabeled(r, e)})") from e
            return out
        names = dict.fromkeys(k for row in rows for k in row)
        columns = {k: [row.get(k) for row in rows] for k in names}
        try:
            return self.fn(list(sources), list(candidates), references, **self._kwargs(columns))
        except RewardError:
            raise
        except Exception as e:
            raise RewardError(f"reward term {self.name} raised {type(e).__name__}: {e}{_raised_at(e)} "
                              f"({self._first_failure(sources, candidates, references, rows)})"
                              f"{self._one_candidate_hint(sources, candidates, references, rows)}") from e

    def _one_candidate_hint(self, sources, candidates, references, rows) -> str:
        """When the batched call failed: whether ``fn`` scores one candidate (called so with the first, it returns
        a number), the function a batched term takes for a per-sample one."""
        try:
            value = self.fn(sources[0], candidates[0], references[0], **self._kwargs(rows[0]))
        except Exception:
            return ""
        if isinstance(value, int | float) and not isinstance(value, bool):
            return "; called with one candidate it returns a number: a function of one candidate needs per_sample: true"
        return ""

    def _first_failure(self, sources, candidates, references, rows) -> str:
        """Which source the batched function fails on alone (calling it again, one candidate at a time)."""
        for i in range(min(len(candidates), _PROBE_LIMIT)):
            try:
                self.fn([sources[i]], [candidates[i]], [references[i]],
                        **self._kwargs({k: [v] for k, v in rows[i].items()}))
            except Exception as e:
                return (f"first failing source: {_short(sources[i])}, candidate {i}: {_short(candidates[i])}"
                        f"{_unlabeled(references[i], e)}")
        return f"on a batch of {len(candidates)} candidates, none of which fails alone; first source " \
               f"{_short(sources[0])}"

    def score(self, sources: Sequence[str], candidates: Sequence[str],
              references: Sequence[Sequence[str]] | None = None,
              fields: Sequence[Mapping[str, Any]] | None = None) -> np.ndarray:
        n = len(candidates)
        if not n:
            return np.zeros(0, dtype=np.float64)
        refs = [list(r) for r in references] if references is not None else [[] for _ in range(n)]
        rows = list(fields) if fields is not None else [{} for _ in range(n)]
        return self._checked(self._call(sources, candidates, refs, rows), sources, candidates)

    def _checked(self, result: Any, sources: Sequence[str], candidates: Sequence[str]) -> np.ndarray:
        """``result`` as float64 [N]; RewardError unless it is N real, finite numbers."""
        n = len(candidates)
        if isinstance(result, str | bytes | Mapping) or not hasattr(result, "__len__"):
            hint = " (a function of one candidate needs per_sample: true)" if isinstance(result, int | float) else ""
            raise RewardError(f"reward term {self.name} returned {type(result).__name__}, not one float per candidate "
                              f"({n}){hint}")
        if len(result) != n:
            raise RewardError(f"reward term {self.name} returned {len(result)} scores for {n} candidates")
        out = np.empty(n, dtype=np.float64)
        for i, value in enumerate(result):
            where = f"candidate {i}: {_short(candidates[i])}, source {_short(sources[i])}"
            try:
                if isinstance(value, str | bytes) or value is None:
                    raise TypeError
                out[i] = float(value)
            except (TypeError, ValueError):
                raise RewardError(f"reward term {self.name} returned {value!r} ({type(value).__name__}), not a "
                                  f"number ({where})") from None
            if not math.isfinite(out[i]):
                raise RewardError(f"reward term {self.name} returned {out[i]} ({where}): rewards must be finite")
        return out
