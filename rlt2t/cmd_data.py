"""`rlt2t config`, `rlt2t data ...` and `rlt2t tokenizer build`: the config tree, data sets and tokenizers."""

from __future__ import annotations

import argparse
from array import array
from collections.abc import Callable, Sequence
from dataclasses import replace
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING

from rlt2t import api
from rlt2t.cmd_common import load_cfg
from rlt2t.common.config import config_to_yaml, explain, explain_derived

if TYPE_CHECKING:
    from rlt2t.common.data import Columns, Example


def cmd_config(args) -> None:
    if args.explain:
        if args.config or args.overrides:
            load_cfg(args)  # a unit of one's own that it names is loaded: its section rl.<name> is listed too
        print("\n".join([*explain(), "", *explain_derived()]))
    else:
        print(config_to_yaml(load_cfg(args)), end="")


def cmd_data_synth(args) -> None:
    files = api.synth_data(load_cfg(args), fmt=args.format, force=args.force)
    for split, path in files.items():
        print(f"{split}: {path}")


def cmd_data_wordnet(args) -> None:
    cfg = load_cfg(args)
    from rlt2t.jobs import check_task_out, make_wordnet_data

    check_task_out(cfg, "jsonl", args.force)
    for split, path in make_wordnet_data(cfg, size=args.size, seed=args.seed, wordnet_dir=args.wordnet_dir).items():
        print(f"{split}: {path}")


def cmd_data_docstrings(args) -> None:
    cfg = load_cfg(args)
    from rlt2t.jobs import check_task_out, make_docstring_data

    check_task_out(cfg, "jsonl", args.force)
    for split, path in make_docstring_data(cfg, size=args.size, seed=args.seed).items():
        print(f"{split}: {path}")


def cmd_data_docstring_names(args) -> None:
    cfg = load_cfg(args)
    from rlt2t.jobs import check_task_out, make_docstring_names_data

    check_task_out(cfg, "jsonl", args.force)
    for split, path in make_docstring_names_data(cfg, seed=args.seed, max_references=args.max_references).items():
        print(f"{split}: {path}")


def cmd_data_import_csv(args) -> None:
    from rlt2t.common.data import import_competition_csv

    cfg = load_cfg(args)
    _import(cfg, args, "diagnoses", lambda: import_competition_csv(args.input, on_error=cfg.data.on_error,
                                                                   require_target=not args.unlabeled))


def cmd_data_import(args) -> None:
    from rlt2t.common.data import load_data

    cfg = load_cfg(args)
    _import(cfg, args, "targets", lambda: list(load_data(args.input, cfg.data, require_target=not args.unlabeled)))


def _import(cfg, args, what: str, read: Callable[[], Sequence[Example]]) -> None:
    """Write what ``read`` returns as train/valid/test JSONL under --out (split by --valid/--test-fraction and
    run.seed), or as test.jsonl without targets (--unlabeled); ``what`` names the targets in messages. The files
    name their fields as the config's data section does (data.source_field ...), so that the settings the
    import ran with read them in every later command."""
    from rlt2t.common.data import Columns, split_examples, write_examples

    if args.unlabeled and (args.valid_fraction is not None or args.test_fraction is not None):
        raise ValueError("--valid-fraction / --test-fraction: --unlabeled writes its rows to test.jsonl alone, the "
                         "inputs `rlt2t predict` reads; RL on sources without targets reads any file with a source "
                         "column as it is (point data.train and data.valid at your files)")
    valid_fraction = 0.05 if args.valid_fraction is None else args.valid_fraction
    test_fraction = 0.0 if args.test_fraction is None else args.test_fraction
    out = Path(args.out)
    test_path = out / "test.jsonl"
    # A labeled import without test rows leaves the test set of an --unlabeled import alone (the order the
    # help gives: labeled first, then the unlabeled test file; a labeled re-import must not delete it).
    columns = Columns.of(cfg.data)
    unlabeled_test = _unlabeled_file(test_path, columns)
    keep_test = not args.unlabeled and test_fraction == 0 and unlabeled_test
    owned = ("test",) if args.unlabeled else ("train", "valid", "test")  # the split files this import replaces
    _check_import_out(out, tuple(s for s in owned if not (keep_test and s == "test")), args.force)
    # A labelled file's rows all need a target; an --unlabeled file has none (any it has are dropped, so the
    # test set reads as unlabeled: _unlabeled_file, a later labelled re-import keeps it)
    examples = read()
    if args.unlabeled:
        dropped = sum(e.target is not None for e in examples)
        write_examples(test_path, [replace(e, target=None, references=()) for e in examples], columns)
        note = f"; {dropped} {what} left out: --unlabeled imports inputs only" if dropped else ""
        print(f"test: {test_path} ({len(examples)} rows{note})")
        return
    parts = split_examples(examples, valid_fraction, test_fraction, cfg.run.seed)
    for split, rows in zip(owned, parts, strict=True):
        path = out / f"{split}.jsonl"
        if rows:
            write_examples(path, rows, columns)
            note = "; it replaced an --unlabeled import's test set" if split == "test" and unlabeled_test else ""
            print(f"{split}: {path} ({len(rows)} rows{note})")
        elif split == "test" and keep_test:
            print(f"test: {path} kept (an --unlabeled import's test set; this import has no test rows: "
                  "--test-fraction 0)")
        elif path.exists():  # an earlier labeled import's split: its rows may now be in train
            path.unlink()
            print(f"{split}: {path} removed (no {split} rows in this import)")


def _unlabeled_file(path: Path, columns: Columns) -> bool:
    """Whether ``path`` is a JSONL file of inputs without targets (what an --unlabeled import writes; a labeled
    import's rows all have one), read with ``columns``."""
    from rlt2t.common.data import load_examples

    if not path.is_file():
        return False
    try:
        examples = load_examples(path, columns=columns, require_target=False)
    except (OSError, ValueError):  # not our JSONL: not an unlabeled import's
        return False
    return bool(examples) and all(e.target is None for e in examples)


def _check_import_out(out: Path, splits: tuple[str, ...], force: bool) -> None:
    """Refuse an --out that is a file, or that holds split files of an earlier import unless --force."""
    from rlt2t.common.data import existing_splits

    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: is a file, not a directory")
    existing = existing_splits(out, splits)
    if existing and not force:
        raise FileExistsError(f"--out {out} already holds {', '.join(existing)} (pass --force to replace them; "
                              "split files this import does not write are then removed, except the test.jsonl "
                              "of an --unlabeled import)")


def cmd_data_validate(args) -> None:
    from rlt2t.common.data import Columns, LoadReport, iter_examples, length_report, token_lengths
    from rlt2t.common.tokenization import load_tokenizer, text_checker
    from rlt2t.jobs import text_tokenizer_dir

    cfg = load_cfg(args)
    where = text_tokenizer_dir(cfg)
    tokenizer = load_tokenizer(where) if where is not None else None
    check = text_checker(tokenizer) if tokenizer is not None else None
    if tokenizer is None:
        print(f"(no tokenizer at {cfg.tokenizer_dir}, and no model.path holding one: token checks and lengths "
              "skipped; `rlt2t tokenizer build` first, or give model.path)")
    else:
        print(f"(tokens of the tokenizer at {where})")
    for path in args.files:
        report = LoadReport(path)
        examples = iter_examples(path, fmt=cfg.data.format, columns=Columns.of(cfg.data),
                                 require_target=not args.unlabeled, on_error=cfg.data.on_error, check_text=check,
                                 report=report)
        # Streamed: a chunk of examples at a time, and of each text only its length in tokens is kept.
        sources, targets = array("I"), array("I")
        while chunk := list(islice(examples, 1024)):
            if tokenizer is not None:
                sources.extend(token_lengths(tokenizer, [e.source for e in chunk]))
                targets.extend(token_lengths(tokenizer, [e.target for e in chunk if e.target is not None]))
        print(report.summary())
        if tokenizer is None:
            continue
        print(length_report(sources, "sources", cfg.data.max_source_len).summary("data.max_source_len"))
        if targets:
            print(length_report(targets, "targets", cfg.data.max_target_len).summary("data.max_target_len"))


def cmd_tokenizer_build(args) -> None:
    print(api.build_tokenizer(load_cfg(args), force=args.force))


def register(sub: argparse._SubParsersAction, config_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add this module's commands to the `rlt2t` parser."""
    p = sub.add_parser("config", help="print the resolved config (or every key with --explain)")
    config_args(p)
    p.add_argument("--explain", action="store_true", help="list every key with its default and meaning")
    p.set_defaults(fn=cmd_config)

    data = sub.add_parser("data", help="make, import and validate data").add_subparsers(
        dest="data_command", required=True, metavar="subcommand")
    p = data.add_parser("synth", help="write the synthetic report task (synth.size, synth.seed) to data.train's dir")
    config_args(p)
    p.add_argument("--format", choices=["jsonl", "csv"], default="jsonl", help="JSONL, or the competition CSV layout")
    p.add_argument("--force", action="store_true", help="replace split files already in data.train's directory")
    p.set_defaults(fn=cmd_data_synth)
    for name, what, fn in (
        ("wordnet", "the WordNet definition-modelling task (natural language)", cmd_data_wordnet),
        ("docstrings", "the docstring-summary task (natural language, from the installed packages' documentation)",
         cmd_data_docstrings),
    ):
        p = data.add_parser(name, help=f"write {what} to data.train's dir")
        config_args(p)
        p.add_argument("--size", type=int, default=8000, help="rows in all (train + synth.valid/test_fraction)")
        p.add_argument("--seed", type=int, default=7, help="which rows are drawn and how they are split")
        if name == "wordnet":
            p.add_argument("--wordnet-dir", default=None,
                           help="WordNet dict directory (default: Debian's wordnet-base)")
        p.add_argument("--force", action="store_true", help="replace split files already in data.train's directory")
        p.set_defaults(fn=fn)
    p = data.add_parser("docstring-names", help="write the several-reference docstring task (a function's name → "
                                                "the summaries of every function of that name) to data.train's dir")
    config_args(p)
    p.add_argument("--seed", type=int, default=7, help="which references are kept and how names are split")
    p.add_argument("--max-references", type=int, default=10, help="references kept per name (at least 2)")
    p.add_argument("--force", action="store_true", help="replace split files already in data.train's directory")
    p.set_defaults(fn=cmd_data_docstring_names)
    for name, what, source, fn in (
        ("import-csv", "a competition CSV (report_id,description,diagnosis[,clinical])", "header-less competition CSV",
         cmd_data_import_csv),
        ("import", "a data file by data.format and the data.*_field column mapping",
         "JSONL, CSV with a header, Parquet, or a Hugging Face datasets directory", cmd_data_import),
    ):
        p = data.add_parser(name, help=f"convert {what} into train/valid/test JSONL")
        config_args(p)
        p.add_argument("--input", required=True, help=source)
        p.add_argument("--out", required=True, help="output directory for train/valid/test JSONL")
        p.add_argument("--valid-fraction", type=float, default=None,
                       help="share of the rows written to valid.jsonl (default 0.05)")
        p.add_argument("--test-fraction", type=float, default=None,
                       help="share of the rows written to test.jsonl (default 0: no test split, as for a task whose "
                            "test set comes without targets, imported with --unlabeled)")
        p.add_argument("--unlabeled", action="store_true",
                       help="the file is a test set without targets (writes test.jsonl only, inputs without targets; "
                            "import it after the labeled file, whose import owns train/valid/test, and whose rows all "
                            "need a target)")
        p.add_argument("--force", action="store_true",
                       help="replace existing split files in --out (a labeled import removes the ones it does not "
                            "write, but keeps the test.jsonl of an --unlabeled import unless it has test rows itself)")
        p.set_defaults(fn=fn)
    p = data.add_parser("validate", help="check data files (any format of data.format, with the data.*_field column "
                                         "mapping; streamed) and their tokens against the run's tokenizer")
    config_args(p)
    p.add_argument("--files", nargs="+", required=True, help="data files or datasets directories")
    p.add_argument("--unlabeled", action="store_true", help="targets are optional")
    p.set_defaults(fn=cmd_data_validate)

    tok = sub.add_parser("tokenizer", help="build the tokenizer").add_subparsers(
        dest="tokenizer_command", required=True, metavar="subcommand")
    p = tok.add_parser("build", help="build (ids), train (subword) or import (pretrained) per tokenizer.kind")
    config_args(p)
    p.add_argument("--force", action="store_true",
                   help="replace the run's tokenizer when these settings build another one (the same one is kept "
                        "without it)")
    p.set_defaults(fn=cmd_tokenizer_build)
