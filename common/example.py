"""What a training example is, and how one row of a data file becomes one, checked.

Every reader (JSONL and the competition CSV in ``rlt2t.common.data``; CSV with a header, Parquet and Hugging
Face datasets in ``rlt2t.common.data_formats``) turns its rows into field dicts and hands them to
:func:`examples_from_rows`, so every format is validated by the same code and fails with the same message:
the file, the 1-based line (or row) and the field, ``data/train.jsonl:17: field 'source': empty``.

Which field holds what is :class:`Columns` (``data.id_field``, ``data.source_field``, ``data.target_field``,
``data.references_field``); error messages name the file's own field (``field 'document': empty``). Every
other field of the row is kept in :attr:`Example.extra`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Container, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from rlt2t.common.config import DataConfig

logger = logging.getLogger("rlt2t.data")

OnError = Literal["raise", "skip"]
TextCheck = Callable[[str], str | None]

RESERVED_FIELDS = ("id", "source", "target", "references")
# How many skip reasons a LoadReport keeps (and the warning shows): enough to diagnose, bounded in memory.
MAX_REASONS = 5


UNLABELED_HINT = ("a file without targets is unlabeled data, which the commands that take it read with --unlabeled "
                  "(data import, data validate; require_target=False in Python); SFT and evaluation need a target on "
                  "every row, RL where its reward or algorithm reads them")
"""What a labelled read of a file without targets says."""

class DataError(ValueError):
    """A problem with input data, located by file, 1-based line (or row) and (when known) field."""

    def __init__(self, path: str | os.PathLike, line: int, field: str | None, reason: str):
        self.path = str(path)
        self.line = line
        self.field = field
        self.reason = reason
        where = f"field '{field}': " if field else ""
        super().__init__(f"{self.path}:{line}: {where}{reason}")


@dataclass(frozen=True, slots=True)
class Example:
    """One source → target pair. ``target`` is None only for unlabeled inputs (prediction-only)."""

    id: str
    source: str
    target: str | None
    extra: dict[str, Any] = field(default_factory=dict, hash=False)
    references: tuple[str, ...] = ()
    """Every reference an output of this source is scored against, when the data gives several; empty: the
    target alone (:attr:`refs`)."""

    def __post_init__(self) -> None:
        # The loaders report problems with file:line context before they get here; this guards
        # examples built in code so an invalid one cannot reach a writer or a model.
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"Example.id must be a non-empty string, got {self.id!r}")
        if not isinstance(self.source, str) or not self.source.strip():
            raise ValueError(f"Example.source must be a non-empty string (id {self.id!r})")
        if self.target is not None and not isinstance(self.target, str):
            raise ValueError(f"Example.target must be a string or None (id {self.id!r})")
        if not isinstance(self.extra, dict):
            raise ValueError(f"Example.extra must be a dict (id {self.id!r})")
        if not (isinstance(self.references, tuple) and all(isinstance(r, str) and r.strip() for r in self.references)):
            raise ValueError(f"Example.references must be a tuple of non-empty strings (id {self.id!r})")
        clash = [k for k in RESERVED_FIELDS if k in self.extra]
        if clash:
            raise ValueError(f"Example.extra must not contain reserved field(s) {clash} (id {self.id!r})")

    def to_dict(self, columns: Columns | None = None) -> dict[str, Any]:
        """The JSONL row: ``id``, ``source``, ``target`` (left out when None), ``references`` (when given), then
        the extra fields; under the names of ``columns`` (default rlt2t's own), so that the mapping a file was
        read with reads it back."""
        c = columns or Columns()
        clash = [k for k in (c.id, c.source, c.target, c.references) if k in self.extra]
        if clash:
            raise ValueError(f"Example.extra holds {clash}, the name(s) the example's own parts are written under "
                             f"(id {self.id!r})")
        row: dict[str, Any] = {c.id: self.id, c.source: self.source}
        if self.target is not None:
            row[c.target] = self.target
        if self.references:
            row[c.references] = list(self.references)
        row.update(self.extra)
        return row

    @property
    def refs(self) -> tuple[str, ...]:
        """What outputs of this source are scored against: its references, else its target alone (empty for
        an unlabeled example)."""
        if self.references:
            return self.references
        return (self.target,) if self.target is not None else ()


@dataclass(frozen=True)
class Columns:
    """The field (column) of a row that holds each part of an example; the defaults are rlt2t's own names."""

    id: str = "id"
    source: str = "source"
    target: str = "target"
    references: str = "references"

    @classmethod
    def of(cls, data: DataConfig) -> Columns:
        """The mapping of a config's data section (``data.id_field`` ...)."""
        return cls(data.id_field, data.source_field, data.target_field, data.references_field)


@dataclass(frozen=True)
class RowRules:
    """How rows become examples: the column mapping, whether a target is required, the text check (called on the
    source, the target and each reference; a non-empty string it returns is why the row is bad), and what a bad
    row does."""

    columns: Columns = Columns()
    require_target: bool = True
    check_text: TextCheck | None = None
    on_error: OnError = "raise"

    def __post_init__(self) -> None:
        check_on_error(self.on_error)


def check_on_error(on_error: str) -> None:
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")


@dataclass
class LoadReport:
    """What a load did: lines (rows) read, examples kept, lines skipped and the first few reasons why."""

    path: str
    lines: int = 0
    loaded: int = 0
    skipped: int = 0
    reasons: list[str] = field(default_factory=list)
    unit: str = "line"
    """What the file's numbers count: ``line`` (JSONL, CSV) or ``row`` (Parquet, datasets)."""

    def _skip(self, err: DataError) -> None:
        self.skipped += 1
        if len(self.reasons) < MAX_REASONS:
            self.reasons.append(str(err))

    def summary(self) -> str:
        """One line for logs and CLIs, e.g. ``train.jsonl: 998 examples, 2 bad line(s) skipped``."""
        text = f"{self.path}: {self.loaded} examples"
        if self.skipped:
            text += f", {self.skipped} bad {self.unit}(s) skipped"
        return text

    def _log_skips(self) -> None:
        if self.skipped:
            logger.warning(
                "%s: skipped %d of %d %s(s) with bad data; first reason(s): %s",
                self.path,
                self.skipped,
                self.lines,
                self.unit,
                "; ".join(self.reasons),
            )


class LoadedExamples(list[Example]):
    """A plain list of examples that also carries the :class:`LoadReport` of the load."""

    report: LoadReport

    def __init__(self, examples: Iterable[Example], report: LoadReport):
        super().__init__(examples)
        self.report = report


class SeenIds:
    """The ids read so far with the line (row) of each, to refuse a duplicate. With ``only``, just those ids are
    remembered: an Arrow file's reader finds the ids that occur more than once in one pass over its id column,
    so a million distinct ids cost no Python dict."""

    def __init__(self, unit: str = "line", only: Container[str] | None = None):
        self.unit = unit
        self.only = only
        self.first: dict[str, int] = {}

    def check(self, ex_id: str, path: str, line: int, name: str) -> None:
        if ex_id in self.first:
            raise DataError(path, line, name, f"duplicate id {ex_id!r} (first on {self.unit} {self.first[ex_id]})")

    def add(self, ex_id: str, line: int) -> None:
        if self.only is None or ex_id in self.only:
            self.first[ex_id] = line


def _names(row: dict[str, Any]) -> str:
    """A row's field names for an error message (the first 12)."""
    names = [repr(k) for k in list(row)[:12]]
    return ", ".join(names) + (", ..." if len(row) > 12 else "") if names else "none"


def example_from_row(row: dict[str, Any], path: str, line: int, rules: RowRules, seen: SeenIds | None,
                     row_id: str | None = None) -> Example:
    """The example of one row (its fields by the file's names; consumed), or a :class:`DataError` naming ``path``,
    ``line`` and the field. ``row_id``: the id of a row of a file without an id column (its row number)."""
    c = rules.columns
    if row_id is not None:
        ex_id = row_id
    else:
        if c.id not in row:
            raise DataError(path, line, c.id, f"missing (the file's first row has one: name every row by "
                                              f"data.id_field, or none and rows are numbered 1, 2, ...; this row's "
                                              f"fields: {_names(row)})")
        ex_id = row.pop(c.id)
        # bool is an int subclass, but `true` as an id is a data bug, not an id.
        if isinstance(ex_id, int) and not isinstance(ex_id, bool):
            ex_id = str(ex_id)
        elif not isinstance(ex_id, str):
            raise DataError(path, line, c.id, _wrong_type("a string or an integer", ex_id))
        if not ex_id.strip():
            raise DataError(path, line, c.id, "empty")
    if seen is not None:
        seen.check(ex_id, path, line, c.id)

    if c.source not in row:
        raise DataError(path, line, c.source, f"missing (data.source_field names the field that holds the source; "
                                              f"this row's other fields: {_names(row)})")
    source = row.pop(c.source)
    if not isinstance(source, str):
        raise DataError(path, line, c.source, _wrong_type("a string", source))
    if not source.strip():
        raise DataError(path, line, c.source, "empty")

    references = _references(row.pop(c.references, None), path, line, c.references)
    has_target_field = c.target in row
    target = row.pop(c.target, None)
    if target is None and references:
        target = references[0]
    if target is None:
        if rules.require_target:
            where = "" if has_target_field else (f"data.target_field or data.references_field name the fields "
                                                 f"that hold targets; this row's other fields: {_names(row)}; ")
            raise DataError(path, line, c.target, f"missing ({where}{UNLABELED_HINT})")
    elif not isinstance(target, str):
        raise DataError(path, line, c.target, _wrong_type("a string", target))
    elif not target.strip():
        raise DataError(path, line, c.target, "empty")
    elif references and target not in references:
        raise DataError(path, line, c.target, "not one of the row's references (SFT would learn a text nothing "
                                              "is scored against): add it to references, or leave target out "
                                              "to take the first")
    # A mapped file's own `source` (say) beside data.source_field=document would shadow the example's part.
    for name in RESERVED_FIELDS:
        if name in row:
            raise DataError(path, line, name, f"a name rlt2t keeps for the example's {name}, which is the field "
                                              f"{getattr(c, name)!r} here (data.{name}_field): rename or drop it")

    if rules.check_text is not None:
        refs = ((f"{c.references}[{i}]", r) for i, r in enumerate(references))
        for name, value in ((c.source, source), (c.target, target), *refs):
            if value is not None and (problem := rules.check_text(value)):
                raise DataError(path, line, name, problem)

    if seen is not None:
        seen.add(ex_id, line)
    return Example(id=ex_id, source=source, target=target, extra=row, references=references)


def _wrong_type(expected: str, value: Any) -> str:
    return f"expected {expected}, got " + ("null" if value is None else type(value).__name__)


def _references(value: Any, path: str, line: int, name: str) -> tuple[str, ...]:
    """A row's references: absent (or null), or a non-empty list of non-empty strings."""
    if value is None:
        return ()
    if not isinstance(value, list | tuple) or not value:
        raise DataError(path, line, name, "expected a non-empty list of strings, got "
                        + (repr(value) if value == [] else type(value).__name__))
    for i, ref in enumerate(value):
        if not isinstance(ref, str):
            raise DataError(path, line, f"{name}[{i}]", _wrong_type("a string", ref))
        if not ref.strip():
            raise DataError(path, line, f"{name}[{i}]", "empty")
    return tuple(value)


def examples_from_rows(rows: Iterable[tuple[int, dict[str, Any] | DataError]], path: str, rules: RowRules,
                       report: LoadReport, seen: SeenIds | None, numbered: bool = False
                       ) -> Iterator[tuple[int, Example]]:
    """Each good row's line (row) number and example, in file order. ``rows`` gives each row's number and fields,
    or the DataError that kept the reader from reading it (a line that is not JSON). A bad row raises, or with
    ``on_error="skip"`` is counted in ``report``; skipped rows are logged once the rows are exhausted.
    ``numbered``: the file has no id column, and each example's id is its row's 1-based position."""
    for position, (line, fields) in enumerate(rows, start=1):
        report.lines += 1
        try:
            if isinstance(fields, DataError):
                raise fields
            example = example_from_row(fields, path, line, rules, seen, str(position) if numbered else None)
        except DataError as err:
            if rules.on_error == "raise":
                raise
            report._skip(err)
            continue
        report.loaded += 1
        yield line, example
    report._log_skips()
