"""Data files beyond JSONL: CSV with a header, Parquet and Hugging Face ``datasets``, read as examples.

Which format a path is (``data.format: auto``, :func:`detect_format`): a directory (a ``save_to_disk`` one) or
an ``.arrow`` file is ``datasets``, ``.parquet``/``.pq`` is Parquet, ``.csv``/``.tsv`` is CSV with a header row,
anything else JSONL. ``data.format: datasets`` on a ``.jsonl``/``.json``/``.csv``/``.tsv``/``.parquet`` file
reads it through ``datasets.load_dataset``, which converts it once into its memory-mapped Arrow cache
(``HF_DATASETS_CACHE``).

Every row goes through :func:`rlt2t.common.example.example_from_row` with the column mapping, so the errors are
JSONL's (``file:line: field 'document': empty``): CSV counts physical lines (the header is line 1), Parquet and
datasets 1-based rows. A file without the id column numbers its rows 1, 2, ... (as a JSONL file whose first row
has no id does). A missing source column, a missing target column where targets are required, or an unmapped
column with a reserved name (``source`` beside ``data.source_field=document``) fail the whole file at once,
whatever ``data.on_error``.
In a CSV cell, empty means no value (target, references) and ``references`` is a JSON list (``["a", "b"]``).

What is streamed and what is materialised:

- Validating (``iter_examples``, what ``rlt2t data validate`` reads) streams every format: JSONL and CSV a line at
  a time, Parquet a row group at a time in record batches of ``BATCH_ROWS``, a datasets table in batches of its
  memory-mapped Arrow. Memory is a row group and a batch, plus for the duplicate-id check the id column as Arrow
  and the ids that occur more than once (:class:`SeenIds`), never a dict of every id.
- Loading (``load_examples``, what the stages read through ``load_split``): Parquet is decoded once, a row group
  at a time, into an Arrow table (compact columns), a datasets directory is its memory-mapped Arrow files (the
  page cache holds them, shared, no copy); either is validated in one batched pass and served as
  :class:`ArrowExamples`, which builds each Example when it is read, so ``rl.train_subset``,
  ``metric.monitor_size`` or a slice cost only their rows. JSONL and CSV become a list of examples, as JSONL
  always did: a text file has no columns to point into (for a very large one, Parquet or
  ``data.format=datasets``).
- The stages then hold what they train on: SFT and pretraining tokenise every text (the token ids are the
  training data), RL its ``rl.train_subset`` as examples (it permutes and chunks them every epoch), eval decodes
  its split in batches.

Ray Data was considered for the rollout workers' shards and rejected: RL's driver sends each worker a chunk of
``rl.chunk_size`` sources together with the policy version that must sample it, in an order that is deterministic
and resumable from a checkpoint (``rlt2t.scheduler``), and re-dispatches a failed worker's chunk. Ray Data's
executor cuts and schedules blocks itself, reserves CPU slots of its own beside the rollout workers, and would
have to be wrapped to keep that order and those versions; a chunk's source texts are small next to the model
that samples them, so the driver's table and Ray's object store carry them well.
"""

from __future__ import annotations

import csv
import errno
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, overload

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rlt2t.common.example import (
    RESERVED_FIELDS,
    UNLABELED_HINT,
    DataError,
    Example,
    LoadedExamples,
    LoadReport,
    RowRules,
    SeenIds,
    example_from_row,
    examples_from_rows,
)

Format = Literal["jsonl", "csv", "parquet", "datasets"]
FORMATS: tuple[str, ...] = ("auto", "jsonl", "csv", "parquet", "datasets")
# Rows per Arrow batch turned into Python objects at a time: the bound on a streamed read's memory.
BATCH_ROWS = 4096
# Rows per chunk of a Parquet file's table in memory (fewer, larger chunks: faster random access).
PARQUET_LOAD_ROWS = 65536
# The `datasets` builder that reads a local file of each suffix (data.format=datasets on a file).
DATASETS_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".tsv": "csv", ".parquet": "parquet"}


def detect_format(path: str | os.PathLike, fmt: str = "auto") -> Format:
    """The format of ``path``: ``fmt`` itself, or with ``auto`` by the path's shape (see the module docstring)."""
    if fmt not in FORMATS:
        raise ValueError(f"data format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt != "auto":
        return fmt  # type: ignore[return-value]  # one of FORMATS but auto
    path = Path(path)
    suffix = path.suffix.lower()
    if path.is_dir() or suffix == ".arrow":
        return "datasets"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    if suffix in (".csv", ".tsv"):
        return "csv"
    return "jsonl"


def stream_examples(path: Path, fmt: Format, rules: RowRules, report: LoadReport) -> Iterator[tuple[int, Example]]:
    """Each good row of a CSV, Parquet or datasets file with its line (row) number, read in bounded memory."""
    if fmt == "csv":
        return _csv_examples(path, rules, report)
    return _arrow_examples(_open_arrow(path, fmt, rules, whole=False), str(path), rules, report)


def load_arrow_examples(path: Path, fmt: Literal["parquet", "datasets"], rules: RowRules) -> ArrowExamples:
    """A Parquet file or a datasets table, validated in one batched pass, as :class:`ArrowExamples`."""
    arrow = _open_arrow(path, fmt, rules, whole=True)
    assert arrow.table is not None
    report = LoadReport(str(path), unit="row")
    kept = np.fromiter((row - 1 for row, _ in _arrow_examples(arrow, str(path), rules, report)), dtype=np.int64)
    rows: range | np.ndarray = range(arrow.table.num_rows) if len(kept) == arrow.table.num_rows else kept
    return ArrowExamples(arrow.table, rows, str(path), replace(rules, check_text=None, on_error="raise"),
                         numbered=arrow.ids is None, report=report)


def check_columns(names: Sequence[str], rules: RowRules, path: str) -> None:
    """Refuse a file whose columns cannot give examples (a whole-file error: ``data.on_error`` skips rows)."""
    c = rules.columns
    have = ", ".join(names) or "none"
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"{path}: column(s) {', '.join(twice)} appear more than once")
    if c.source not in names:
        raise ValueError(f"{path}: no column {c.source!r} (data.source_field) among its columns: {have}")
    if rules.require_target and c.target not in names and c.references not in names:
        raise ValueError(f"{path}: no column {c.target!r} (data.target_field) or {c.references!r} "
                         f"(data.references_field) among its columns: {have} ({UNLABELED_HINT})")
    mapped = {c.id, c.source, c.target, c.references}
    for name in RESERVED_FIELDS:
        if name in names and name not in mapped:
            raise ValueError(f"{path}: column {name!r} has a name rlt2t keeps for the example's {name}, which is the "
                             f"column {getattr(c, name)!r} here (data.{name}_field): rename or drop it")


class ArrowExamples(Sequence[Example]):
    """Validated examples backed by an Arrow table: each :class:`Example` is built when it is read, so a million
    rows cost the table (memory-mapped, for a datasets directory), not a million Python objects. A slice is a view
    of the same table; pickled (sent to a Ray worker) it travels as the list of its examples. ``report`` is the
    load's :class:`LoadReport`."""

    def __init__(self, table: pa.Table, rows: range | np.ndarray, path: str, rules: RowRules, *, numbered: bool,
                 report: LoadReport):
        self._table, self._rows, self._path, self._rules, self._numbered = table, rows, path, rules, numbered
        self.report = report

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, key: int) -> Example: ...

    @overload
    def __getitem__(self, key: slice) -> ArrowExamples: ...

    def __getitem__(self, key: int | slice) -> Example | ArrowExamples:
        if isinstance(key, slice):
            return ArrowExamples(self._table, self._rows[key], self._path, self._rules, numbered=self._numbered,
                                 report=self.report)
        row = int(self._rows[key])  # an IndexError out of range, as a list's
        return next(self._examples(range(row, row + 1)))

    def __iter__(self) -> Iterator[Example]:
        for start in range(0, len(self._rows), BATCH_ROWS):
            yield from self._examples(self._rows[start : start + BATCH_ROWS])

    def _examples(self, rows: range | np.ndarray) -> Iterator[Example]:
        if isinstance(rows, range) and rows.step == 1:
            part = self._table.slice(rows.start, len(rows))
        else:
            part = self._table.take(pa.array(np.asarray(rows, dtype=np.int64)))
        for index, (_, fields) in zip(rows, _arrow_rows(part.to_batches()), strict=True):
            row = int(index) + 1
            yield example_from_row(fields, self._path, row, self._rules, None, str(row) if self._numbered else None)

    def __reduce__(self) -> tuple[Any, ...]:
        return LoadedExamples, (list(self), self.report)

    def __repr__(self) -> str:
        return f"<ArrowExamples: {len(self)} of {self._path}>"


# --------------------------------------------------------------------------------------------------
# Arrow: Parquet and Hugging Face datasets
# --------------------------------------------------------------------------------------------------


@dataclass
class _ArrowFile:
    names: list[str]
    ids: pa.ChunkedArray | None
    """The id column (for the duplicate check), None when the file has none and rows are numbered."""
    batches: Iterable[pa.RecordBatch]
    table: pa.Table | None
    """The whole table (a datasets one, memory-mapped, or a Parquet file read whole), None when streamed."""


def _open_arrow(path: Path, fmt: Format, rules: RowRules, *, whole: bool) -> _ArrowFile:
    if not path.exists():  # the OSError a JSONL file gives, not a reader's message around it
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
    id_name = rules.columns.id
    if fmt == "datasets":  # memory-mapped: reading it whole costs nothing
        table = dataset_table(path)
        check_columns(table.column_names, rules, str(path))
        ids = table.column(id_name) if id_name in table.column_names else None
        return _ArrowFile(table.column_names, ids, table.to_batches(max_chunksize=BATCH_ROWS), table)
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: not readable as Parquet ({e})") from None
    names = parquet.schema_arrow.names
    check_columns(names, rules, str(path))
    if whole:
        table = pa.Table.from_batches(list(_parquet_batches(parquet, PARQUET_LOAD_ROWS)), schema=parquet.schema_arrow)
        ids = table.column(id_name) if id_name in names else None
        return _ArrowFile(names, ids, table.to_batches(max_chunksize=BATCH_ROWS), table)
    ids = parquet.read(columns=[id_name]).column(0) if id_name in names else None
    return _ArrowFile(names, ids, _parquet_batches(parquet, BATCH_ROWS), None)


def _parquet_batches(parquet: pq.ParquetFile, size: int) -> Iterator[pa.RecordBatch]:
    """The file's rows in batches, a row group at a time: one reader over the whole file keeps memory that grows
    with the file (and ``ParquetFile.read`` peaks at over twice the table), one per row group stays within it."""
    for group in range(parquet.num_row_groups):
        yield from parquet.iter_batches(batch_size=size, row_groups=[group])


def dataset_table(path: Path) -> pa.Table:
    """The Arrow table of a ``save_to_disk`` directory or an ``.arrow`` file (memory-mapped), or of a local file
    loaded through ``datasets.load_dataset`` (converted once into its memory-mapped cache)."""
    suffix = path.suffix.lower()
    if path.is_dir() and (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise ValueError(f"{path}: a DatasetDict directory (splits: {', '.join(splits) or 'none'}): point data.train, "
                         f"data.valid and data.test at one split directory each, e.g. {path / 'train'}")
    if path.is_dir() and not (path / "state.json").is_file():
        raise ValueError(f"{path}: a directory, but not one Hugging Face datasets saved (save_to_disk writes "
                         "state.json and data-*.arrow files there)")
    if not path.is_dir() and suffix != ".arrow" and suffix not in DATASETS_BUILDERS:
        raise ValueError(f"{path}: data.format=datasets reads a save_to_disk directory or a "
                         f"{', '.join(['.arrow', *DATASETS_BUILDERS])} file")
    import datasets  # a second to import: only when a datasets file is read

    try:
        if path.is_dir():
            ds = datasets.load_from_disk(str(path))
        elif suffix == ".arrow":
            ds = datasets.Dataset.from_file(str(path))
        else:
            options = {"delimiter": "\t"} if suffix == ".tsv" else {}
            ds = datasets.load_dataset(DATASETS_BUILDERS[suffix], data_files=str(path), split="train", **options)
    except (OSError, pa.ArrowException, datasets.exceptions.DatasetsError) as e:
        raise ValueError(f"{path}: not readable as a Hugging Face dataset ({type(e).__name__}: {e})") from None
    return ds.with_format("arrow")[:]


def _arrow_rows(batches: Iterable[pa.RecordBatch]) -> Iterator[tuple[int, dict[str, Any]]]:
    """Each row's 1-based number and fields, a batch's rows turned into Python objects at a time."""
    row = 0
    for batch in batches:
        columns = batch.to_pydict()
        names = list(columns)
        for values in zip(*columns.values(), strict=True):
            row += 1
            yield row, dict(zip(names, values, strict=True))


def _arrow_examples(arrow: _ArrowFile, path: str, rules: RowRules, report: LoadReport
                    ) -> Iterator[tuple[int, Example]]:
    seen = SeenIds("row", only=_repeated_ids(arrow.ids)) if arrow.ids is not None else None
    return examples_from_rows(_arrow_rows(arrow.batches), path, rules, report, seen, numbered=arrow.ids is None)


def _repeated_ids(ids: pa.ChunkedArray) -> set[str]:
    """The ids that occur more than once (as the strings the examples get): the only ones the duplicate check has
    to remember. An id column of another type fails every row's id check anyway."""
    if not (pa.types.is_string(ids.type) or pa.types.is_large_string(ids.type) or pa.types.is_integer(ids.type)):
        return set()
    counts = pc.value_counts(ids)
    repeated = counts.filter(pc.greater(counts.field("counts"), 1)).field("values")
    return {str(v) for v in repeated.to_pylist() if v is not None}


# --------------------------------------------------------------------------------------------------
# CSV with a header row
# --------------------------------------------------------------------------------------------------


def _csv_examples(path: Path, rules: RowRules, report: LoadReport) -> Iterator[tuple[int, Example]]:
    records = csv_records(path, delimiter="\t" if path.suffix.lower() == ".tsv" else ",")
    header = next(records, None)
    if header is None:
        return iter(())
    if isinstance(header[1], DataError):
        raise header[1]
    names = [n.strip() for n in header[1]]
    check_columns(names, rules, str(path))
    rows = (_csv_fields(line, cells, names, rules, str(path)) for line, cells in records)
    return examples_from_rows(rows, str(path), rules, report, SeenIds(), numbered=rules.columns.id not in names)


def _csv_fields(line: int, cells: list[str] | DataError, names: list[str], rules: RowRules, path: str
                ) -> tuple[int, dict[str, Any] | DataError]:
    """A CSV row's fields by the header's names: an empty target or references cell is no value, a references
    cell a JSON list; or the DataError that makes the row bad."""
    if isinstance(cells, DataError):
        return line, cells
    if len(cells) != len(names):
        return line, DataError(path, line, None, f"expected {len(names)} columns like the header, got {len(cells)}")
    fields: dict[str, Any] = dict(zip(names, cells, strict=True))
    c = rules.columns
    for name in (c.target, c.references):
        if fields.get(name) == "":
            fields[name] = None
    if fields.get(c.references) is not None:
        try:
            fields[c.references] = json.loads(fields[c.references])
        except json.JSONDecodeError:
            return line, DataError(path, line, c.references, 'expected a JSON list of strings in the cell, e.g. '
                                                             '["first reference", "second"]')
    return line, fields


def csv_records(path: str | os.PathLike, delimiter: str = ",") -> Iterator[tuple[int, list[str] | DataError]]:
    """Each non-blank record of a CSV file with its (last) physical line, or the DataError of a record with bytes
    that are not UTF-8. The csv module's own errors (a NUL byte, a field over its size limit) raise
    :class:`DataError` naming the file and line: the reader cannot go on after them."""
    bad: dict[int, str] = {}  # line -> why it is not text
    reader = csv.reader(_text_lines(path, bad), delimiter=delimiter)
    while True:
        first = reader.line_num + 1
        try:
            cells = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            raise DataError(path, reader.line_num, None, f"not readable as CSV ({e})") from None
        broken = [line for line in range(first, reader.line_num + 1) if line in bad]
        if broken:
            yield reader.line_num, DataError(path, broken[0], None, bad.pop(broken[0]))
        elif cells and not (len(cells) == 1 and not cells[0].strip()):
            yield reader.line_num, cells


def _text_lines(path: str | os.PathLike, bad: dict[int, str]) -> Iterator[str]:
    """The file's lines decoded one by one (so a bad byte is located on its own line, which goes in ``bad``)."""
    with open(path, "rb") as f:
        for line, raw in enumerate(f, start=1):
            if line == 1 and raw.startswith(b"\xef\xbb\xbf"):  # UTF-8 byte-order mark
                raw = raw[3:]
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as e:
                bad[line] = f"not valid UTF-8 ({e.reason} at byte {e.start})"
                yield raw.decode("utf-8", errors="replace")
