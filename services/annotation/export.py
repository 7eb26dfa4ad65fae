"""Exports of the annotation database, in the formats the reward-model trainer reads (``rlt2t reward-model train``).

- ``ranks.tsv``: one rank list per line: the source, then its candidates best first, tab-separated
  (``source<TAB>best<TAB>…<TAB>worst``), one line per (annotator, item) ranking. The format has no escapes,
  so tabs, carriage returns and newlines inside a text become single spaces here (counted in ``cleaned``).
- ``pairs.jsonl``: ``{"source", "chosen", "rejected"}`` for every ordered pair of every ranking (K choose 2
  per list, the better one first).
- ``ratings.jsonl``: ``{"source", "candidate", "rating"}`` for every rated candidate.

Flagged annotations are left out unless ``include_flagged``; skipped items are never exported. Rankings of a
single candidate carry no preference and are left out of both rank files.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from rlt2t.common.io import atomic_open, atomic_write_jsonl
from rlt2t.services.annotation.store import Store

_SEPARATORS = re.compile(r"[\t\r\n]+")
FILES = {"ranks": "ranks.tsv", "pairs": "pairs.jsonl", "ratings": "ratings.jsonl"}


@dataclass
class ExportCounts:
    rank_lists: int = 0
    pairs: int = 0
    ratings: int = 0
    cleaned: int = 0
    """Texts whose tabs or line breaks became spaces in ranks.tsv."""


def tsv_field(text: str) -> tuple[str, bool]:
    """``text`` safe for one TSV field, and whether it had to change."""
    cleaned = _SEPARATORS.sub(" ", text)
    return cleaned, cleaned != text


def rank_lists(store: Store, *, include_flagged: bool = False, annotator: str | None = None
               ) -> Iterator[tuple[str, list[str]]]:
    """(source, texts best first) of every exportable ranking."""
    for source, texts in store.rank_lists(include_flagged=include_flagged, annotator=annotator):
        if len(texts) >= 2:
            yield source, texts


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


def rating_rows(store: Store, *, include_flagged: bool = False, annotator: str | None = None
                ) -> Iterator[dict[str, str | float]]:
    for source, candidate, rating in store.ratings(include_flagged=include_flagged, annotator=annotator):
        yield {"source": source, "candidate": candidate, "rating": rating}


def jsonl_lines(rows: Iterable[dict]) -> Iterator[str]:
    """One JSON object per line, as ``atomic_write_jsonl`` writes them."""
    for row in rows:
        yield json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n"


def export_all(store: Store, out_dir: str | Path, *, include_flagged: bool = False,
               annotator: str | None = None) -> ExportCounts:
    """Write ranks.tsv, pairs.jsonl and ratings.jsonl under ``out_dir`` (each atomically); returns the counts."""
    out_dir = Path(out_dir)
    counts = ExportCounts()
    lists = list(rank_lists(store, include_flagged=include_flagged, annotator=annotator))
    with atomic_open(out_dir / FILES["ranks"]) as f:
        f.writelines(rank_tsv_lines(lists, counts))
    counts.pairs = atomic_write_jsonl(out_dir / FILES["pairs"], pair_rows(lists))
    counts.ratings = atomic_write_jsonl(out_dir / FILES["ratings"],
                                        rating_rows(store, include_flagged=include_flagged, annotator=annotator))
    return counts
