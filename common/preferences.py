"""Preference data: what a reward model learns from, read from and written to three file formats.

- **Rank lists** (TSV, the trl-based sentiment tutorial's format with the prompt first): one list per line,
  ``source<TAB>best<TAB>second<TAB>...<TAB>worst``, at least two candidates, all distinct.
- **Pairs** (JSONL): ``{"source": ..., "chosen": ..., "rejected": ...}`` per line.
- **Ratings** (JSONL): ``{"source": ..., "candidate": ..., "rating": number}`` per line; the candidates of one
  source become pairs (every higher-rated one over every lower-rated one; equal ratings make no pair).

Each becomes a :class:`PreferenceGroup`: a source, its candidates and the ordered pairs (better, worse) among
them. A rank list of K gives K·(K-1)/2 pairs, a pairs line one, a source's ratings as many as its ratings
order; the loss weights each group once (docs/design.md, reward models). Bad lines fail with
``file:line: field '...': reason`` (:class:`rlt2t.common.data.DataError`); nothing is skipped silently.
The annotation app's export writes rank lists and pairs with :func:`write_rank_lists` / :func:`write_pairs`.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from rlt2t.common.candidates import stable_seed
from rlt2t.common.data import DataError
from rlt2t.common.io import atomic_open

log = logging.getLogger("rlt2t.preferences")


@dataclass(frozen=True)
class PreferenceGroup:
    """One source's candidates and what is known about their order.

    ``pairs`` holds (better, worse) indices into ``candidates``; ``origin`` is ``file:line`` of the
    group's (first) line, for messages.
    """

    source: str
    candidates: tuple[str, ...]
    pairs: tuple[tuple[int, int], ...]
    origin: str = ""

    def __post_init__(self) -> None:
        n = len(self.candidates)
        for better, worse in self.pairs:
            if not (0 <= better < n and 0 <= worse < n) or better == worse:
                raise ValueError(f"PreferenceGroup {self.origin}: bad pair ({better}, {worse}) for {n} candidates")


def rank_list_group(source: str, ranked: Sequence[str], origin: str = "") -> PreferenceGroup:
    """A rank list (best first) as a group: every ordered pair i < j, K·(K-1)/2 of them."""
    k = len(ranked)
    return PreferenceGroup(source, tuple(ranked), tuple((i, j) for i in range(k) for j in range(i + 1, k)), origin)


def _text(value: object, path: Path, line: int, field: str) -> str:
    if not isinstance(value, str):
        raise DataError(path, line, field, f"must be a string, got {type(value).__name__}")
    if not value.strip():
        raise DataError(path, line, field, "empty")
    return value


def _lines(path: str | os.PathLike) -> Iterable[tuple[int, str]]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"file not found: {path}")
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark (Excel's exports)
                raw = raw[3:]
            try:
                text = raw.decode("utf-8").rstrip("\n").rstrip("\r")
            except UnicodeDecodeError as e:
                raise DataError(path, number, None, f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
            if text.strip():
                yield number, text


def read_rank_lists(path: str | os.PathLike) -> list[PreferenceGroup]:
    """Rank-list TSV → groups (one per non-blank line)."""
    path = Path(path)
    groups = []
    for number, text in _lines(path):
        cols = text.split("\t")
        source = _text(cols[0], path, number, "source")
        ranked = [_text(c, path, number, f"candidate {i}") for i, c in enumerate(cols[1:], start=1)]
        if len(ranked) < 2:
            raise DataError(path, number, "candidates", f"a rank list needs >= 2 tab-separated candidates after the "
                                                        f"source, got {len(ranked)}")
        seen: dict[str, int] = {}
        for i, c in enumerate(ranked, start=1):
            if c in seen:
                raise DataError(path, number, f"candidate {i}", f"repeats candidate {seen[c]}: a rank list orders "
                                                                "distinct candidates")
            seen[c] = i
        groups.append(rank_list_group(source, ranked, f"{path}:{number}"))
    return groups


def json_objects(path: str | os.PathLike, strings: Sequence[str] = ()) -> Iterator[tuple[int, dict]]:
    """The JSON objects of a JSONL file with their line numbers (blank lines skipped, a byte-order mark dropped),
    each with the fields ``strings`` holding strings; DataError naming the file, line and field otherwise."""
    path = Path(path)
    for number, text in _lines(path):
        try:
            row = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(path, number, None, f"not valid JSON: {e.msg}") from None
        if not isinstance(row, dict):
            named = f" with {' and '.join(f'`{f}`' for f in strings)}" if strings else ""
            raise DataError(path, number, None, f"expected a JSON object{named}, got {type(row).__name__}")
        for f in strings:
            if not isinstance(row.get(f), str):
                raise DataError(path, number, f, "missing or not a string")
        yield number, row


def _require(row: dict, fields: Sequence[str], path: Path, number: int) -> None:
    for f in fields:
        if f not in row:
            raise DataError(path, number, f, "missing")


def read_pairs(path: str | os.PathLike) -> list[PreferenceGroup]:
    """Pairwise JSONL (``source``, ``chosen``, ``rejected``) → one two-candidate group per line."""
    path = Path(path)
    groups = []
    for number, row in json_objects(path):
        _require(row, ("source", "chosen", "rejected"), path, number)
        source = _text(row["source"], path, number, "source")
        chosen = _text(row["chosen"], path, number, "chosen")
        rejected = _text(row["rejected"], path, number, "rejected")
        if chosen == rejected:
            raise DataError(path, number, "rejected", "equals chosen")
        groups.append(rank_list_group(source, [chosen, rejected], f"{path}:{number}"))
    return groups


def read_ratings(path: str | os.PathLike) -> list[PreferenceGroup]:
    """Ratings JSONL (``source``, ``candidate``, ``rating``) → one group per source, in first-seen order.

    Every candidate rated higher than another makes a pair; a candidate rated twice for one source is an
    error (which rating holds?); a source whose ratings are all equal has nothing to learn and is dropped
    (logged).
    """
    path = Path(path)
    by_source: dict[str, dict] = {}
    for number, row in json_objects(path):
        _require(row, ("source", "candidate", "rating"), path, number)
        source = _text(row["source"], path, number, "source")
        candidate = _text(row["candidate"], path, number, "candidate")
        rating = row["rating"]
        if isinstance(rating, bool) or not isinstance(rating, int | float) or not math.isfinite(rating):
            raise DataError(path, number, "rating", f"must be a finite number, got {rating!r}")
        entry = by_source.setdefault(source, {"line": number, "ratings": {}, "lines": {}})
        if candidate in entry["ratings"]:
            raise DataError(path, number, "candidate", f"already rated for this source on line "
                                                       f"{entry['lines'][candidate]}")
        entry["ratings"][candidate] = float(rating)
        entry["lines"][candidate] = number
    groups, flat = [], 0
    for source, entry in by_source.items():
        cands = list(entry["ratings"])
        r = [entry["ratings"][c] for c in cands]
        pairs = tuple((i, j) for i in range(len(cands)) for j in range(len(cands)) if r[i] > r[j])
        if not pairs:
            flat += 1
            continue
        groups.append(PreferenceGroup(source, tuple(cands), pairs, f"{path}:{entry['line']}"))
    if flat:
        log.info("%s: %d sources whose candidates all share one rating were dropped (no pair to learn)", path, flat)
    return groups


def load_preferences(rank_lists: Sequence[str | os.PathLike] = (), pairs: Sequence[str | os.PathLike] = (),
                     ratings: Sequence[str | os.PathLike] = (), *, key: str = "") -> list[PreferenceGroup]:
    """All groups of the given files, in file order. Preferences that two files share are warned about: the
    annotation export writes each ranking to both ranks.tsv and pairs.jsonl, so passing both would weight each
    ranking twice. ``key``: the config section that names the files (``rl.dpo``), named with a missing one."""
    groups: list[PreferenceGroup] = []
    per_file: list[tuple[str, set[int]]] = []  # each file's (source, better, worse) preferences, hashed
    for kind, paths, read in (("rank_lists", rank_lists, read_rank_lists), ("pairs", pairs, read_pairs),
                              ("ratings", ratings, read_ratings)):
        for p in paths:
            if key and not Path(p).is_file():
                raise FileNotFoundError(f"{key}.{kind}: file not found: {p}")
            read_now = read(p)
            groups += read_now
            per_file.append((str(p), {hash((g.source, g.candidates[b], g.candidates[w])) for g in read_now
                                      for b, w in g.pairs}))
    for i, (first, a) in enumerate(per_file):
        for second, b in per_file[i + 1:]:
            if shared := len(a & b):
                log.warning("%s and %s share %d preferences (of %d and %d): each shared one is learned twice (the "
                            "annotation export writes each ranking to both ranks.tsv and pairs.jsonl: pass one of "
                            "those two; ratings.jsonl holds the ratings, and shares a preference only where one was "
                            "both ranked and rated)", first, second, shared, len(a), len(b))
    return groups


def check_preference_texts(groups: Sequence[PreferenceGroup], check_text: Callable[[str], str | None]) -> None:
    """Every source and candidate under a tokenizer's token rule (``text_checker``): a special token such as
    ``</s>`` in a text would reach the reward model as a control token (and the reward server refuses it).
    DataError at the group's ``origin`` (for ratings, the source's first line)."""
    for g in groups:
        path, _, line = g.origin.rpartition(":")
        texts = [("source", g.source), *((f"candidate {i}", c) for i, c in enumerate(g.candidates, start=1))]
        for field, text in texts:
            if (problem := check_text(text)) is not None:
                raise DataError(path, int(line) if line.isdigit() else 0, field, problem)


def split_by_source(groups: Sequence[PreferenceGroup], valid_fraction: float, seed: int
                    ) -> tuple[list[PreferenceGroup], list[PreferenceGroup]]:
    """(train, held-out): a source goes wholly to one side, chosen by a seeded hash of its text, so the
    held-out accuracy is measured on sources the model never saw."""
    if valid_fraction <= 0:
        return list(groups), []
    scale = 2**63

    def held_out(source: str) -> bool:
        return stable_seed(seed, "reward-split", source) / scale < valid_fraction

    train = [g for g in groups if not held_out(g.source)]
    valid = [g for g in groups if held_out(g.source)]
    return train, valid


def _check_field(text: str, what: str) -> str:
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{what}: must be a non-empty string")
    if "\t" in text or "\n" in text or "\r" in text:
        raise ValueError(f"{what}: contains a tab or a line break, which the rank-list TSV cannot hold")
    return text


def write_rank_lists(path: str | os.PathLike, lists: Iterable[tuple[str, Sequence[str]]]) -> int:
    """Write (source, candidates best first) lists as rank-list TSV, atomically; returns the count.

    Texts with tabs or line breaks are refused (the format cannot hold them), as are lists with fewer than
    two or repeated candidates.
    """
    n = 0
    with atomic_open(path) as f:
        for i, (source, ranked) in enumerate(lists):
            cols = [_check_field(source, f"lists[{i}].source")]
            cols += [_check_field(c, f"lists[{i}].candidates[{j}]") for j, c in enumerate(ranked)]
            if len(ranked) < 2 or len(set(ranked)) != len(ranked):
                raise ValueError(f"lists[{i}]: a rank list needs >= 2 distinct candidates, got {list(ranked)!r}")
            f.write("\t".join(cols) + "\n")
            n += 1
    return n


def write_pairs(path: str | os.PathLike, pairs: Iterable[tuple[str, str, str]]) -> int:
    """Write (source, chosen, rejected) triples as pairwise JSONL, atomically; returns the count."""
    n = 0
    with atomic_open(path) as f:
        for i, (source, chosen, rejected) in enumerate(pairs):
            for what, text in (("source", source), ("chosen", chosen), ("rejected", rejected)):
                if not isinstance(text, str) or not text.strip():
                    raise ValueError(f"pairs[{i}].{what}: must be a non-empty string")
            if chosen == rejected:
                raise ValueError(f"pairs[{i}]: chosen equals rejected")
            row = {"source": source, "chosen": chosen, "rejected": rejected}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n
