"""Exports of the annotation database, in the formats the reward-model trainer reads (``rlt2t reward-model train``).

- ``ranks.tsv``: one rank list per line: the source, then its candidates best first, tab-separated
  (``source<TAB>best<TAB>…<TAB>worst``), one line per (annotator, item) ranking. The format has no escapes,
  so tabs, carriage returns and newlines inside a text become single spaces here (counted in ``cleaned``).
- ``pairs.jsonl``: ``{"source", "chosen", "rejected"}`` for every ordered pair of every exported rank list
  (K choose 2 per list, the better one first), with the texts as they are (no cleaning).
- ``ratings.jsonl``: ``{"source", "candidate", "rating"}``, one row per (source, candidate text): the trainer
  refuses a candidate rated twice for one source, so the ratings of every annotator (and of every item with
  that source) are merged into their mean, and such a row carries ``"raters"``: how many ratings it averages
  (absent: one). The trainer ignores the extra field.

The trainer also refuses a blank text or a rank list that repeats a candidate. A ranking therefore loses its
blank candidates and any candidate that, once cleaned for ranks.tsv, equals a better-ranked one (the
better-ranked one stays; ``"a<TAB>b"`` ranked below ``"a b"`` goes); a ranking left with fewer than two
candidates, or with a blank source, is left out of both rank files, which so hold the same lists. Blank rated
candidates are left out of ratings.jsonl. What was left out is counted in :class:`ExportCounts` and logged.

Flagged annotations are left out unless ``include_flagged``; skipped items are never exported. Rankings of a
single candidate carry no preference and are left out of both rank files.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from rlt2t.common.io import atomic_open, atomic_write_jsonl
from rlt2t.services.annotation.store import Store

log = logging.getLogger("rlt2t.services.annotation")

_SEPARATORS = re.compile(r"[\t\r\n]+")
FILES = {"ranks": "ranks.tsv", "pairs": "pairs.jsonl", "ratings": "ratings.jsonl"}


@dataclass
class ExportCounts:
    rank_lists: int = 0
    pairs: int = 0
    ratings: int = 0
    """Rows of ratings.jsonl (one per source and candidate)."""
    cleaned: int = 0
    """Texts whose tabs or line breaks became spaces in ranks.tsv."""
    dropped_candidates: int = 0
    """Candidates left out of a ranking: blank, or equal to a better-ranked one once cleaned."""
    dropped_lists: int = 0
    """Rankings left out: a blank source, or fewer than two candidates after dropping those."""
    dropped_ratings: int = 0
    """Ratings of a blank candidate or source, left out."""
    merged_ratings: int = 0
    """Ratings averaged into another one's row (same source and candidate: another annotator's, or another
    item's)."""


def tsv_field(text: str) -> tuple[str, bool]:
    """``text`` safe for one TSV field, and whether it had to change."""
    cleaned = _SEPARATORS.sub(" ", text)
    return cleaned, cleaned != text


def usable_ranking(texts: Iterable[str]) -> tuple[list[str], int]:
    """(the texts the trainer accepts in one rank list, how many were dropped): blank ones and those equal to a
    better-ranked one once cleaned for ranks.tsv and their whitespace collapsed ("3 " and " 3" look the same to
    an annotator and to a tokenizer that splits on it) go, the first of equals stays."""
    kept: list[str] = []
    seen: set[str] = set()
    dropped = 0
    for text in texts:
        key = " ".join(tsv_field(text)[0].split())
        if not key or key in seen:
            dropped += 1
            continue
        seen.add(key)
        kept.append(text)
    return kept, dropped


def rank_lists(store: Store, *, include_flagged: bool = False, annotator: str | None = None,
               counts: ExportCounts | None = None) -> Iterator[tuple[str, list[str]]]:
    """(source, texts best first) of every exportable ranking (see the module docstring for what is dropped;
    the drops are added to ``counts`` and logged once the rankings are exhausted)."""
    dropped_candidates = dropped_lists = 0
    for source, texts in store.rank_lists(include_flagged=include_flagged, annotator=annotator):
        kept, dropped = usable_ranking(texts)
        dropped_candidates += dropped
        if len(kept) >= 2 and source.strip():
            yield source, kept
        elif len(texts) >= 2:  # a single candidate never was a preference: not counted as a drop
            dropped_lists += 1
    if counts is not None:
        counts.dropped_candidates += dropped_candidates
        counts.dropped_lists += dropped_lists
    if dropped_candidates or dropped_lists:
        log.warning("export: %d blank or (once tabs and line breaks are spaces) repeated candidates left out of "
                    "rankings; %d rankings left out (blank source or fewer than two candidates left)",
                    dropped_candidates, dropped_lists)


def rank_tsv_lines(lists: Iterable[tuple[str, list[str]]], counts: ExportCounts | None = None) -> Iterator[str]:
    """``source\\tbest\\t…\\tworst\\n`` per rank list."""
    for source, texts in lists:
        fields = [tsv_field(t) for t in (source, *texts)]
        if counts is not None:
            counts.rank_lists += 1
            counts.cleaned += sum(changed for _, changed in fields)
        yield "\t".join(f for f, _ in fields) + "\n"


def pair_rows(lists: Iterable[tuple[str, list[str]]]) -> Iterator[dict[str, str]]:
    """Every ordered pair of every rank list: ``{"source", "chosen", "rejected"}``, chosen ranked higher."""
    for source, texts in lists:
        for i, chosen in enumerate(texts):
            for rejected in texts[i + 1:]:
                yield {"source": source, "chosen": chosen, "rejected": rejected}


def rating_rows(store: Store, *, include_flagged: bool = False, annotator: str | None = None,
                counts: ExportCounts | None = None) -> Iterator[dict[str, str | float | int]]:
    """One row per (source, candidate text) in first-rated order: the mean of its ratings, and ``raters`` (how
    many) when more than one; blank texts are left out (see the module docstring)."""
    merged: dict[tuple[str, str], list[float]] = {}
    dropped = 0
    for source, candidate, rating in store.ratings(include_flagged=include_flagged, annotator=annotator):
        if not source.strip() or not candidate.strip():
            dropped += 1
            continue
        merged.setdefault((source, candidate), []).append(rating)
    n_merged = sum(len(v) - 1 for v in merged.values())
    if counts is not None:
        counts.dropped_ratings += dropped
        counts.merged_ratings += n_merged
    if dropped:
        log.warning("export: %d ratings of a blank candidate or source left out", dropped)
    if n_merged:
        log.info("export: %d ratings of a (source, candidate) rated more than once averaged into one row",
                 n_merged)
    for (source, candidate), values in merged.items():
        if len(values) == 1:
            yield {"source": source, "candidate": candidate, "rating": values[0]}
        else:
            yield {"source": source, "candidate": candidate, "rating": math.fsum(values) / len(values),
                   "raters": len(values)}


def jsonl_lines(rows: Iterable[dict]) -> Iterator[str]:
    """One JSON object per line, as ``atomic_write_jsonl`` writes them."""
    for row in rows:
        yield json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n"


def export_all(store: Store, out_dir: str | Path, *, include_flagged: bool = False,
               annotator: str | None = None) -> ExportCounts:
    """Write ranks.tsv, pairs.jsonl and ratings.jsonl under ``out_dir`` (each atomically); returns the counts.
    An ``annotator`` the store does not know is a ValueError, before any file is written (it would export
    nothing over an earlier export)."""
    if annotator is not None and store.annotator_by_name(annotator) is None:
        known = ", ".join(store.annotator_names()) or "none yet"
        raise ValueError(f"--annotator {annotator}: no such annotator (known: {known})")
    out_dir = Path(out_dir)
    counts = ExportCounts()
    lists = list(rank_lists(store, include_flagged=include_flagged, annotator=annotator, counts=counts))
    with atomic_open(out_dir / FILES["ranks"]) as f:
        f.writelines(rank_tsv_lines(lists, counts))
    counts.pairs = atomic_write_jsonl(out_dir / FILES["pairs"], pair_rows(lists))
    counts.ratings = atomic_write_jsonl(out_dir / FILES["ratings"], rating_rows(
        store, include_flagged=include_flagged, annotator=annotator, counts=counts))
    return counts
