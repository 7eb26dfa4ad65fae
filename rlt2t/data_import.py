"""Importing a data file into a run: `rlt2t data import` / `data import-csv` and ``rlt2t.import_data``.

One file of any format (or the competition's CSV) is split into train / valid / test JSONL by the fractions and
``run.seed``, or written as an unlabeled test set. The files name their fields as the config's data section does
(``data.source_field`` ...), so the settings the import ran with read them in every later command.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from rlt2t.common.config import Config
from rlt2t.common.data import (
    Columns,
    existing_splits,
    import_competition_csv,
    load_data,
    load_examples,
    split_examples,
    write_examples,
)

DEFAULT_VALID_FRACTION = 0.05
"""Share of a labelled import's rows written to valid.jsonl when no fraction is given."""


def import_data(cfg: Config, input: str | os.PathLike, out: str | os.PathLike | None = None, *,
                valid_fraction: float | None = None, test_fraction: float | None = None, unlabeled: bool = False,
                force: bool = False, competition_csv: bool = False,
                report: Callable[[str], None] = print) -> dict[str, Path]:
    """Read ``input`` (any data format with the config's column mapping, or the competition's header-less CSV with
    ``competition_csv``) and write it under ``out`` (default data.train's directory): split into train / valid /
    test JSONL (``valid_fraction``, default 0.05; ``test_fraction``, default 0), or, ``unlabeled``, as test.jsonl
    of inputs alone (targets and references left out). Returns split → file written; ``report`` gets one line per
    split file written, kept or removed. Split files already in ``out`` raise FileExistsError unless ``force``;
    a labelled import without test rows keeps an unlabeled import's test.jsonl."""
    if unlabeled and (valid_fraction is not None or test_fraction is not None):
        raise ValueError("--valid-fraction / --test-fraction: --unlabeled writes its rows to test.jsonl alone, the "
                         "inputs `rlt2t predict` reads; RL on sources without targets reads any file with a source "
                         "column as it is (point data.train and data.valid at your files)")
    valid_fraction = DEFAULT_VALID_FRACTION if valid_fraction is None else valid_fraction
    test_fraction = 0.0 if test_fraction is None else test_fraction
    out = Path(out) if out is not None else cfg.path(cfg.data.train).parent
    test_path = out / "test.jsonl"
    columns = Columns.of(cfg.data)
    # A labeled import without test rows leaves the test set of an --unlabeled import alone (the order the
    # help gives: labeled first, then the unlabeled test file; a labeled re-import must not delete it).
    unlabeled_test = _unlabeled_file(test_path, columns)
    keep_test = not unlabeled and test_fraction == 0 and unlabeled_test
    owned = ("test",) if unlabeled else ("train", "valid", "test")  # the split files this import replaces
    _check_import_out(out, tuple(s for s in owned if not (keep_test and s == "test")), force)
    # A labelled file's rows all need a target; an --unlabeled file has none (any it has are dropped, so the
    # test set reads as unlabeled: _unlabeled_file, a later labelled re-import keeps it)
    what = "diagnoses" if competition_csv else "targets"
    examples = (import_competition_csv(input, on_error=cfg.data.on_error, require_target=not unlabeled)
                if competition_csv else list(load_data(input, cfg.data, require_target=not unlabeled)))
    if unlabeled:
        dropped = sum(e.target is not None for e in examples)
        write_examples(test_path, [replace(e, target=None, references=()) for e in examples], columns)
        note = f"; {dropped} {what} left out: --unlabeled imports inputs only" if dropped else ""
        report(f"test: {test_path} ({len(examples)} rows{note})")
        return {"test": test_path}
    written: dict[str, Path] = {}
    parts = split_examples(examples, valid_fraction, test_fraction, cfg.run.seed)
    for split, rows in zip(owned, parts, strict=True):
        path = out / f"{split}.jsonl"
        if rows:
            write_examples(path, rows, columns)
            written[split] = path
            note = "; it replaced an --unlabeled import's test set" if split == "test" and unlabeled_test else ""
            report(f"{split}: {path} ({len(rows)} rows{note})")
        elif split == "test" and keep_test:
            report(f"test: {path} kept (an --unlabeled import's test set; this import has no test rows: "
                   "--test-fraction 0)")
        elif path.exists():  # an earlier labeled import's split: its rows may now be in train
            path.unlink()
            report(f"{split}: {path} removed (no {split} rows in this import)")
    return written


def _unlabeled_file(path: Path, columns: Columns) -> bool:
    """Whether ``path`` is a JSONL file of inputs without targets (what an --unlabeled import writes; a labeled
    import's rows all have one), read with ``columns``."""
    if not path.is_file():
        return False
    try:
        examples = load_examples(path, columns=columns, require_target=False)
    except (OSError, ValueError):  # not our JSONL: not an unlabeled import's
        return False
    return bool(examples) and all(e.target is None for e in examples)


def _check_import_out(out: Path, splits: tuple[str, ...], force: bool) -> None:
    """Refuse an --out that is a file, or that holds split files of an earlier import unless --force."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: is a file, not a directory")
    existing = existing_splits(out, splits)
    if existing and not force:
        raise FileExistsError(f"--out {out} already holds {', '.join(existing)} (pass --force, force=True in "
                              "Python, to replace them; split files this import does not write are then removed, "
                              "except the test.jsonl of an --unlabeled import)")
