"""The data contract: what a training example is, and how examples are read and written.

Every stage of rlt2t consumes :class:`Example` objects (``rlt2t.common.example``: the type and the checks every
row goes through). rlt2t's own files are JSONL, one object per line::

    {"id": "17", "source": "12 7 <sep> 5 6 7", "target": "40 41", ...any other fields...}

``id`` may be a string or an integer (read back as a string; a file whose first row has none numbers its rows 1, 2,
..., and then no row may have one), ``source`` is a non-empty string,
``target`` a non-empty string (optional for unlabeled inputs such as a prediction-only test split);
every other field is kept in :attr:`Example.extra`.

Several references (COCO-style captions, several translations): ``"references": ["...", "..."]``, a
non-empty list of non-empty strings, every output a source may be scored against; metrics, rewards and
CIDEr-D's document frequencies use them all (:attr:`Example.refs`). SFT and rank RL's gold still learn
``target``, which defaults to the first reference and must be one of them; to learn every reference, write one
row per reference (each with the same ``references``), as COCO-style likelihood training does.

:func:`load_examples` and :func:`iter_examples` also read CSV with a header, Parquet and Hugging Face
``datasets``, with the fields under the file's own names (:class:`Columns`: ``data.source_field`` ...);
``rlt2t.common.data_formats`` says how the format is told and what is streamed.

Bad data is never dropped silently. Each problem becomes a :class:`DataError` whose message names
the file, the 1-based line and the field (``data/train.jsonl:17: field 'source': empty``). With
``on_error="skip"`` the bad lines are skipped instead, counted in a :class:`LoadReport`, and a warning
with the count and the first reasons is logged on the ``rlt2t.data`` logger.

The module also imports the competition's header-less CSV layout
(``report_id,description,diagnosis[,clinical]``) and exports submissions (``report_id,prediction``).
"""

from __future__ import annotations

import csv
import json
import math
import os
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from rlt2t.common.data_formats import ArrowExamples, detect_format, load_arrow_examples, stream_examples
from rlt2t.common.example import (
    MAX_REASONS,
    RESERVED_FIELDS,
    Columns,
    DataError,
    Example,
    LoadedExamples,
    LoadReport,
    OnError,
    RowRules,
    SeenIds,
    TextCheck,
    check_on_error,
    examples_from_rows,
)
from rlt2t.common.io import atomic_open, atomic_write_json, atomic_write_jsonl

if TYPE_CHECKING:
    from rlt2t.common.config import DataConfig

__all__ = [
    "MAX_REASONS", "RESERVED_FIELDS", "ArrowExamples", "Columns", "DataError", "Example", "LengthReport",
    "LoadReport", "LoadedExamples", "OnError", "TextCheck", "export_competition_csv", "import_competition_csv",
    "iter_examples", "length_report", "load_data", "load_examples", "reference_sets", "references_of",
    "split_examples", "split_sizes", "targets_of", "token_lengths", "unique_references", "write_examples",
    "write_sampled_task",
]

T = TypeVar("T")

# The competition CSV columns, in file order; a file has the first 2, 3 or 4 of them.
COMPETITION_COLUMNS = ("report_id", "description", "diagnosis", "clinical")


def references_of(examples: Sequence[Example], what: str) -> list[list[str]]:
    """Each labelled example's references (:attr:`Example.refs`), in order: what ``metric.corpus`` and
    ``per_sample`` take; ValueError naming ``what`` for an unlabeled one."""
    targets_of(examples, what)
    return [list(e.refs) for e in examples]


def unique_references(examples: Iterable[Example]) -> Iterator[tuple[Example, tuple[str, ...]]]:
    """Each example with its references (:attr:`Example.refs`), or none when an earlier row gave the same source
    the same ``references`` (one row per reference, COCO-style): what a corpus of the data holds once."""
    seen: set[tuple[str, tuple[str, ...]]] = set()
    for e in examples:
        if e.references:
            if (e.source, e.references) in seen:
                yield e, ()
                continue
            seen.add((e.source, e.references))
        yield e, e.refs


def reference_sets(examples: Iterable[Example]) -> list[list[str]]:
    """The reference sets of labelled ``examples`` for CIDEr-D's document frequencies: one per example, except
    that rows repeating the same source and ``references`` count once, as the source they describe does."""
    return [list(refs) for _, refs in unique_references(examples) if refs]


def targets_of(examples: Sequence[Example], what: str) -> list[str]:
    """The targets of labelled ``examples``, in order; ValueError naming ``what`` for an unlabeled one."""
    targets = [e.target for e in examples if e.target is not None]
    if len(targets) != len(examples):
        unlabeled = next(e.id for e in examples if e.target is None)
        raise ValueError(f"{what} needs targets; example {unlabeled!r} has none")
    return targets




def iter_examples(
    path: str | os.PathLike,
    *,
    fmt: str = "auto",
    columns: Columns | None = None,
    require_target: bool = True,
    on_error: OnError = "raise",
    check_text: TextCheck | None = None,
    report: LoadReport | None = None,
) -> Iterator[Example]:
    """Stream examples from a data file in bounded memory (see the module docstring for the format and the errors).

    ``fmt``: ``auto`` (by the path: ``rlt2t.common.data_formats.detect_format``), ``jsonl``, ``csv``,
    ``parquet`` or ``datasets``; ``columns``: which field holds what (default rlt2t's own names). Blank lines are
    ignored. ``check_text`` is called on the source, the target and each reference; a non-empty string it returns
    is the reason the line is bad. Pass a ``report`` to read the counts afterwards (its ``unit`` is set to the
    format's: ``line`` or ``row``); skipped lines are logged when the file has been read to the end.
    """
    rules = RowRules(columns or Columns(), require_target, check_text, on_error)  # a bad argument fails here
    kind = detect_format(path, fmt)
    if report is None:
        report = LoadReport(str(path))
    report.unit = "line" if kind in ("jsonl", "csv") else "row"
    if kind == "jsonl":
        rows, numbered = _numbered(_jsonl_rows(str(path)), rules.columns.id, str(path))
        stream = examples_from_rows(rows, str(path), rules, report, SeenIds(), numbered=numbered)
    else:
        stream = stream_examples(Path(path), kind, rules, report)
    return (example for _, example in stream)


def _numbered(rows: Iterator[tuple[int, dict[str, Any] | DataError]], id_field: str, path: str
              ) -> tuple[Iterator[tuple[int, dict[str, Any] | DataError]], bool]:
    """(the rows, whether they are numbered): a JSONL file whose first row has no ``id_field`` numbers its rows 1, 2,
    ... as a CSV, Parquet or datasets file without the id column does; a later row that has one is then refused
    (named and numbered rows would mix)."""
    first = next(rows, None)
    if first is None:
        return iter(()), False
    numbered = isinstance(first[1], dict) and id_field not in first[1]

    def checked() -> Iterator[tuple[int, dict[str, Any] | DataError]]:
        yield first
        for line, fields in rows:
            if numbered and isinstance(fields, dict) and id_field in fields:
                fields = DataError(path, line, id_field, "present, but the file's first row has none, so its rows are "
                                                         "numbered 1, 2, ...: give every row an id (data.id_field), "
                                                         "or none")
            yield line, fields

    return checked(), numbered


def _jsonl_rows(path: str) -> Iterator[tuple[int, dict[str, Any] | DataError]]:
    """Each non-blank line's number and object, or the DataError of a line that is not a JSON object."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):  # UTF-8 byte-order mark
                raw = raw[3:]
            if raw.strip():
                yield lineno, _json_object(raw, path, lineno)


def _json_object(raw: bytes, path: str, lineno: int) -> dict[str, Any] | DataError:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return DataError(path, lineno, None, f"not valid UTF-8 ({e.reason} at byte {e.start})")
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        return DataError(path, lineno, None, f"not valid JSON ({e.msg}, column {e.colno})")
    except (ValueError, RecursionError) as e:  # an integer of > 4300 digits, nesting deeper than the stack
        return DataError(path, lineno, None, f"not valid JSON here ({type(e).__name__}: {str(e)[:120]})")
    if not isinstance(row, dict):
        return DataError(path, lineno, None, f"expected a JSON object, got {type(row).__name__}")
    return row


def load_examples(
    path: str | os.PathLike,
    *,
    fmt: str = "auto",
    columns: Columns | None = None,
    require_target: bool = True,
    on_error: OnError = "raise",
    check_text: TextCheck | None = None,
) -> LoadedExamples | ArrowExamples:
    """Read and check a whole data file (arguments as :func:`iter_examples`); the result's ``.report`` has the
    counts. JSONL and CSV give a list; Parquet and datasets an :class:`ArrowExamples` sequence over the file's
    Arrow table, which builds each example when it is read."""
    rules = RowRules(columns or Columns(), require_target, check_text, on_error)
    kind = detect_format(path, fmt)
    if kind in ("parquet", "datasets"):
        return load_arrow_examples(Path(path), kind, rules)
    report = LoadReport(str(path))
    examples = iter_examples(path, fmt=kind, columns=rules.columns, require_target=require_target,
                             on_error=on_error, check_text=check_text, report=report)
    return LoadedExamples(examples, report)


def load_data(path: str | os.PathLike, data: DataConfig, *, require_target: bool = True,
              check_text: TextCheck | None = None) -> LoadedExamples | ArrowExamples:
    """:func:`load_examples` as a config's data section reads files: ``data.format``, the column mapping
    (``data.source_field`` ...) and ``data.on_error``."""
    return load_examples(path, fmt=data.format, columns=Columns.of(data), require_target=require_target,
                         on_error=data.on_error, check_text=check_text)


def existing_splits(out: Path, splits: Sequence[str] = ("train", "valid", "test"), fmt: str = "jsonl") -> list[str]:
    """The split files among ``splits`` already in ``out`` (``{split}.{fmt}``)."""
    return [str(out / f"{s}.{fmt}") for s in splits if (out / f"{s}.{fmt}").exists()]


def write_examples(path: str | os.PathLike, examples: Iterable[Example], columns: Columns | None = None) -> int:
    """Write examples as JSONL atomically (nothing appears at ``path`` on error); returns the row count. Fields are
    named by ``columns`` (default rlt2t's own: ``id``, ``source``, ``target``, ``references``).

    Raises ValueError on a duplicate id, so a written file always loads back (with the same ``columns``).
    """
    seen: set[str] = set()

    def rows() -> Iterator[dict[str, Any]]:
        for i, ex in enumerate(examples):
            if not isinstance(ex, Example):
                raise ValueError(f"examples[{i}] must be an Example, got {type(ex).__name__}")
            if ex.id in seen:
                raise ValueError(f"examples[{i}]: duplicate id {ex.id!r}")
            seen.add(ex.id)
            yield ex.to_dict(columns)

    return atomic_write_jsonl(path, rows())


# --------------------------------------------------------------------------------------------------
# The competition's CSV layout
# --------------------------------------------------------------------------------------------------


def _token_text(value: str, path: str, lineno: int, name: str) -> str:
    """Normalise whitespace and check that every token is a non-negative integer."""
    tokens = value.split()
    for tok in tokens:
        if not (tok.isascii() and tok.isdigit()):
            raise DataError(path, lineno, name, f"token {tok!r} is not a non-negative integer")
    return " ".join(tokens)


def _parse_csv_row(
    cells: list[str],
    width: int,
    path: str,
    lineno: int,
    separator_token: str,
    check_text: TextCheck | None,
    seen: dict[str, int],
    require_target: bool,
) -> Example:
    if len(cells) != width:
        names = ", ".join(COMPETITION_COLUMNS[:width])
        raise DataError(
            path, lineno, None, f"expected {width} columns ({names}) like the first row, got {len(cells)}"
        )
    report_id = cells[0].strip()
    if not report_id:
        raise DataError(path, lineno, "report_id", "empty")
    if report_id in seen:
        raise DataError(
            path, lineno, "report_id", f"duplicate id {report_id!r} (first on line {seen[report_id]})"
        )

    texts = {
        name: _token_text(cells[i], path, lineno, name)
        for i, name in enumerate(COMPETITION_COLUMNS[1:width], 1)
    }
    if not texts["description"]:
        raise DataError(path, lineno, "description", "empty")
    if require_target and not texts.get("diagnosis"):
        raise DataError(path, lineno, "diagnosis", f"{'empty' if 'diagnosis' in texts else 'missing'} (every row of "
                        "a labelled file needs one; a test file without diagnoses is imported with --unlabeled)")
    if check_text is not None:
        for name, value in texts.items():
            if value and (problem := check_text(value)):
                raise DataError(path, lineno, name, problem)

    description = texts["description"]
    if "clinical" in texts:
        # Always include the separator when the file has the column, so the model sees one format.
        clinical = texts["clinical"]
        source = (
            f"{clinical} {separator_token} {description}" if clinical else f"{separator_token} {description}"
        )
    else:
        source = description
    seen[report_id] = lineno
    return Example(id=report_id, source=source, target=texts.get("diagnosis") or None)


def import_competition_csv(
    path: str | os.PathLike,
    *,
    separator_token: str = "<sep>",
    on_error: OnError = "raise",
    check_text: TextCheck | None = None,
    require_target: bool = False,
) -> LoadedExamples:
    """Read the competition's header-less CSV: ``report_id,description[,diagnosis[,clinical]]``.

    The first non-blank row fixes the column count (2, 3 or 4); every row must have it. Texts are
    space-separated non-negative integer token ids; whitespace is normalised to single spaces.
    ``source`` is ``clinical <sep> description`` when the file has a clinical column (the separator
    is there even when clinical is empty: ``<sep> 5 6 7``), else the description. An empty or absent
    diagnosis gives ``target=None``, or with ``require_target`` (a labelled file) makes the row bad.
    ``check_text`` is called on each non-empty text column. Bad rows
    (wrong column count, a non-integer token, empty description or id, duplicate id) raise
    :class:`DataError` or, with ``on_error="skip"``, are counted and logged as in :func:`iter_examples`.
    """
    check_on_error(on_error)
    if not separator_token or separator_token != separator_token.strip():
        raise ValueError(f"separator_token must be a non-empty token without spaces, got {separator_token!r}")
    path_str = str(path)
    report = LoadReport(path_str)
    examples: list[Example] = []
    seen: dict[str, int] = {}
    width: int | None = None
    # A bad byte becomes U+FFFD and then fails the integer-token check with its line and column named.
    with open(path, encoding="utf-8-sig", errors="replace", newline="") as f:
        reader = csv.reader(f)
        for cells in _csv_rows(reader, path_str):
            lineno = reader.line_num
            if not cells or (len(cells) == 1 and not cells[0].strip()):
                continue
            report.lines += 1
            try:
                if width is None:
                    if not 2 <= len(cells) <= 4:
                        raise DataError(
                            path_str,
                            lineno,
                            None,
                            f"expected 2 to 4 columns ({', '.join(COMPETITION_COLUMNS)}), got {len(cells)}",
                        )
                    width = len(cells)
                example = _parse_csv_row(cells, width, path_str, lineno, separator_token, check_text, seen,
                                         require_target)
            except DataError as err:
                if on_error == "raise":
                    raise
                report._skip(err)
                continue
            report.loaded += 1
            examples.append(example)
    report._log_skips()
    return LoadedExamples(examples, report)


def export_competition_csv(
    path: str | os.PathLike, ids: Sequence[str | int], predictions: Sequence[str]
) -> int:
    """Write a submission: header-less ``report_id,prediction`` rows, atomically; returns the row count.

    The competition's submission format has no header line, so none is written. Whitespace inside a
    prediction is normalised to single spaces (so a stray newline cannot break a row); an empty
    prediction is written as an empty field.
    """
    if len(ids) != len(predictions):
        raise ValueError(
            f"ids and predictions must have the same length, got {len(ids)} and {len(predictions)}"
        )
    seen: set[str] = set()
    with atomic_open(path) as f:
        writer = csv.writer(f, lineterminator="\n")
        for i, (rid, pred) in enumerate(zip(ids, predictions, strict=True)):
            rid_str = str(rid).strip()
            if not rid_str:
                raise ValueError(f"ids[{i}] is empty")
            if rid_str in seen:
                raise ValueError(f"ids[{i}]: duplicate id {rid_str!r}")
            if not isinstance(pred, str):
                raise ValueError(f"predictions[{i}] must be a string, got {type(pred).__name__}")
            seen.add(rid_str)
            writer.writerow([rid_str, " ".join(pred.split())])
    return len(ids)


def _csv_rows(reader: Any, path: str) -> Iterator[list[str]]:
    """The reader's rows, its own errors (a field over the csv module's size limit, a NUL byte) named with
    the file and line."""
    while True:
        try:
            yield next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            raise DataError(path, reader.line_num, None, f"not readable as CSV ({e})") from None


def split_sizes(n: int, valid_fraction: float, test_fraction: float, what: str) -> tuple[int, int]:
    """Rows of valid and test out of ``n``: at least one for a positive fraction, and train keeps one."""
    n_valid = max(1, round(n * valid_fraction)) if valid_fraction > 0 else 0
    n_test = max(1, round(n * test_fraction)) if test_fraction > 0 else 0
    if n - n_valid - n_test < 1:
        raise ValueError(f"{what}: {n} item(s) are too few for a train split plus {n_valid} valid and {n_test} test")
    return n_valid, n_test


def split_examples(
    items: Sequence[T], valid_fraction: float, test_fraction: float, seed: int
) -> tuple[list[T], list[T], list[T]]:
    """Deterministically split ``items`` into (train, valid, test); each keeps the input order.

    A split with a positive fraction gets at least one item; train must keep at least one.
    The same items, fractions and seed always give the same split (``random.Random(seed)``).
    """
    for name, frac in (("valid_fraction", valid_fraction), ("test_fraction", test_fraction)):
        if not 0.0 <= frac < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {frac}")
    if valid_fraction + test_fraction >= 1.0:
        raise ValueError(f"valid_fraction + test_fraction must be < 1, got {valid_fraction + test_fraction}")
    n = len(items)
    n_valid, n_test = split_sizes(n, valid_fraction, test_fraction, "items")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    valid_idx = sorted(order[:n_valid])
    test_idx = sorted(order[n_valid : n_valid + n_test])
    held_out = set(order[: n_valid + n_test])
    train = [items[i] for i in range(n) if i not in held_out]
    return train, [items[i] for i in valid_idx], [items[i] for i in test_idx]


def write_sampled_task(out_dir: str | os.PathLike, rows: Sequence[dict[str, Any]], size: int, seed: int,
                       valid_fraction: float, test_fraction: float, meta_name: str,
                       meta: dict[str, Any]) -> dict[str, Path]:
    """Draw ``size`` of ``rows`` (``random.Random(seed).sample``), cut valid then test then train off the draw,
    write ``train``/``valid``/``test`` JSONL atomically and ``meta_name`` last (``meta`` plus the size, seed,
    rows available and rows per split). Returns the paths keyed ``train``, ``valid``, ``test``, ``meta``.

    For tasks built from a pool larger than the run wants (the docstring and WordNet tasks); the caller checks
    ``size`` against the pool so its error can say where the pool came from.
    """
    if not 0 < size <= len(rows):
        raise ValueError(f"size must be in [1, {len(rows)}], got {size}")
    for name, frac in (("valid_fraction", valid_fraction), ("test_fraction", test_fraction)):
        if not 0.0 <= frac < 0.5:
            raise ValueError(f"{name} must be in [0, 0.5), got {frac}")
    n_valid, n_test = split_sizes(size, valid_fraction, test_fraction, "size")
    picked = random.Random(seed).sample(list(rows), size)
    splits = {"valid": picked[:n_valid], "test": picked[n_valid : n_valid + n_test],
              "train": picked[n_valid + n_test :]}
    out = Path(out_dir)
    paths = {}
    for split, split_rows in splits.items():
        paths[split] = out / f"{split}.jsonl"
        atomic_write_jsonl(paths[split], split_rows)
    paths["meta"] = out / meta_name
    atomic_write_json(paths["meta"], {**meta, "size": size, "seed": seed, "available": len(rows),
                                      **{f"{k}_rows": len(v) for k, v in splits.items()}})
    return paths


@dataclass(frozen=True)
class LengthReport:
    """Token lengths of one field of a data file under a tokenizer (EOS included, as the limits count them)."""

    field: str
    limit: int
    """The config limit (data.max_source_len or data.max_target_len)."""
    over: int
    """Texts longer than the limit (truncated in training)."""
    count: int
    percentiles: dict[int, int]
    """50th, 90th, 99th percentile and 100th (the longest), in tokens."""

    def summary(self, key: str) -> str:
        p = self.percentiles
        return (f"  {self.field}: {self.over} of {self.count} over {key}={self.limit} tokens; length p50 {p[50]}, "
                f"p90 {p[90]}, p99 {p[99]}, max {p[100]}")


def token_lengths(tokenizer, texts: Sequence[str]) -> list[int]:
    """Each text's length in tokens under ``tokenizer``, EOS included (as the limits count them)."""
    return [len(x) for x in tokenizer(list(texts), add_special_tokens=True)["input_ids"]] if texts else []


def length_report(lengths: Iterable[int], field: str, limit: int) -> LengthReport:
    """How many texts of token ``lengths`` (:func:`token_lengths`) exceed ``limit``, and the lengths' percentiles
    (nearest rank), so limits can be chosen before training."""
    ordered = sorted(lengths)

    def rank(q: int) -> int:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))] if ordered else 0

    return LengthReport(field, limit, sum(n > limit for n in ordered), len(ordered),
                        {q: rank(q) for q in (50, 90, 99, 100)})
