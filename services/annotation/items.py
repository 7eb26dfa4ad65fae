"""Items to annotate: a source and K candidates, read from a candidates JSONL file or sampled from a policy server.

Candidates JSONL, one item per line::

    {"id": "ex-1", "source": "12 7 33", "candidates": ["4 5", "4 6", "9"]}

``id`` is optional (kept as the item's external id); a candidate is a string or an object with a ``text``
field, so ``rlt2t predict``'s ``<out>.candidates.jsonl`` loads as it is. Candidates are deduplicated (first
occurrence kept). A bad line fails with ``file:line: field '…': reason`` (``DataError``, as the data loaders),
text no database can store (a NUL character, a lone surrogate) included.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace

from tqdm import tqdm

from rlt2t.common.data import DataError, Example
from rlt2t.services.annotation.export import usable_ranking
from rlt2t.services.annotation.store import NewItem, unstorable
from rlt2t.services.client import PolicyClient

log = logging.getLogger("rlt2t.services.annotation")


def distinct(texts: Sequence[str]) -> tuple[str, ...]:
    """``texts`` without repeats, first occurrences in order."""
    return tuple(dict.fromkeys(texts))


def rankable(items: Iterable[NewItem], check: Callable[[str], str | None] | None = None
             ) -> tuple[list[NewItem], int, str | None]:
    """The items people can rank and a reward model can train on, the number left out and the first reason.
    An item keeps the candidates a ranking of it exports (``usable_ranking``: blank ones and those equal to
    another once cleaned for ranks.tsv dropped) and needs at least two; with ``check`` (the run's
    ``text_checker``: what it says is wrong with a text, or None) its source and every candidate must pass,
    else its export would stop ``reward-model train`` at that line."""
    kept, skipped, first = [], 0, None
    for item in items:
        item = replace(item, candidates=tuple(usable_ranking(item.candidates)[0]))
        problem = "fewer than 2 distinct non-blank candidates" if len(item.candidates) < 2 else next(
            (f"{text!r}: {why}" for text in (item.source, *item.candidates) if check and (why := check(text))), None)
        if problem is None:
            kept.append(item)
        else:
            skipped, first = skipped + 1, first or f"{item.ext_id or item.source[:40]!r}: {problem}"
    return kept, skipped, first


def _storable(text: str, path: str, lineno: int, field: str, what: str = "") -> None:
    """JSON can spell text no database stores: a lone surrogate (``"\\ud800"``: no UTF-8) or NUL (``"\\u0000"``:
    PostgreSQL refuses it)."""
    problem = unstorable(text)
    if problem is not None:
        raise DataError(path, lineno, field, f"{what}{problem}")


def _candidate_texts(value: object, path: str, lineno: int) -> list[str]:
    if not isinstance(value, list):
        raise DataError(path, lineno, "candidates", f"expected a list, got {type(value).__name__}")
    texts = []
    for k, c in enumerate(value):
        if isinstance(c, dict):
            c = c.get("text")
        if not isinstance(c, str):
            raise DataError(path, lineno, "candidates", f"candidate {k}: expected a string or an object with a "
                                                        f"string 'text', got {type(c).__name__}")
        _storable(c, path, lineno, "candidates", f"candidate {k}: ")
        texts.append(c)
    return texts


def read_candidates(path: str | os.PathLike, *, max_candidates: int, max_chars: int) -> Iterator[NewItem]:
    """Items of a candidates JSONL file (see the module docstring); raises DataError on the first bad line."""
    path = str(path)
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise DataError(path, lineno, None, f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
            except json.JSONDecodeError as e:
                raise DataError(path, lineno, None, f"not valid JSON ({e.msg}, column {e.colno})") from None
            if not isinstance(row, dict):
                raise DataError(path, lineno, None, f"expected a JSON object, got {type(row).__name__}")
            source = row.get("source")
            if not isinstance(source, str) or not source.strip():
                raise DataError(path, lineno, "source", "missing or empty" if source is None or isinstance(source, str)
                                else f"expected a string, got {type(source).__name__}")
            _storable(source, path, lineno, "source")
            if "candidates" not in row:
                raise DataError(path, lineno, "candidates", "missing")
            texts = distinct(_candidate_texts(row["candidates"], path, lineno))
            if not texts:
                raise DataError(path, lineno, "candidates", "empty list")
            if len(texts) > max_candidates:
                raise DataError(path, lineno, "candidates", f"{len(texts)} distinct candidates; at most "
                                                            f"{max_candidates} (annotate.max_candidates_per_item)")
            too_long = [k for k, t in enumerate((source, *texts)) if len(t) > max_chars]
            if too_long:
                where = "source" if too_long[0] == 0 else "candidates"
                raise DataError(path, lineno, where, f"longer than {max_chars} characters (annotate.max_text_chars)")
            ext_id = None if row.get("id") is None else str(row["id"])[:200]
            if ext_id is not None:
                _storable(ext_id, path, lineno, "id")
            yield NewItem(source=source, candidates=texts, origin=os.path.basename(path), ext_id=ext_id)


def sample_items(client: PolicyClient, examples: Sequence[Example], *, num_candidates: int, top_k: int,
                 temperature: float, max_new_tokens: int, batch_size: int = 16, progress: bool = True
                 ) -> list[NewItem]:
    """Sample ``num_candidates`` candidates per source on a policy server; duplicates of a source are merged, so an
    item may hold fewer (a source whose samples are all alike yields one candidate). A source no database can
    store is a ValueError naming its example, before anything is sampled; a sampled candidate no database can
    store (a byte-level tokenizer can decode NUL) is left out, and counted in a warning."""
    for e in examples:
        if (problem := unstorable(e.source)) is not None:
            raise ValueError(f"source of example {e.id!r}: {problem}")
    out: list[NewItem] = []
    dropped = 0
    with tqdm(total=len(examples), desc="sampling candidates", unit="source", disable=not progress) as bar:
        for start in range(0, len(examples), batch_size):
            chunk = examples[start:start + batch_size]
            answer = client.candidates([e.source for e in chunk], num_candidates=num_candidates, top_k=top_k,
                                       temperature=temperature, max_new_tokens=max_new_tokens)
            origin = f"{client.base_url} policy version {answer.policy_version}"
            for example, cands in zip(chunk, answer.candidates, strict=True):
                texts = [c.text for c in cands if unstorable(c.text) is None]
                dropped += len(cands) - len(texts)
                if texts:
                    out.append(NewItem(source=example.source, candidates=distinct(texts), origin=origin,
                                       ext_id=example.id, policy_version=answer.policy_version))
            bar.update(len(chunk))
    if dropped:
        log.warning("annotate: %d sampled candidates left out: text no database can store (a NUL character or a "
                    "lone surrogate)", dropped)
    return out
