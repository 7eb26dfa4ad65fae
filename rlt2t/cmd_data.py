"""`rlt2t config`, `rlt2t data ...` and `rlt2t tokenizer build`: the config tree, data sets and tokenizers."""

from __future__ import annotations

import argparse
from array import array
from collections.abc import Callable
from itertools import islice

from rlt2t import api
from rlt2t.cmd_common import load_cfg
from rlt2t.common.config import config_to_yaml, explain, explain_derived


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
    _import(args, competition_csv=True)


def cmd_data_import(args) -> None:
    _import(args, competition_csv=False)


def _import(args, *, competition_csv: bool) -> None:
    from rlt2t.data_import import import_data

    import_data(load_cfg(args), args.input, args.out, valid_fraction=args.valid_fraction,
                test_fraction=args.test_fraction, unlabeled=args.unlabeled, force=args.force,
                competition_csv=competition_csv, report=print)


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
