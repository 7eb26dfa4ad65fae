"""`rlt2t annotate ...` (registered by rlt2t.cli): human annotation of policy candidates.

    rlt2t annotate add-user NAME [--admin] [--reset] [--token-file FILE]   # prints the annotator's token
    rlt2t annotate load --candidates FILE.jsonl                            # items from a candidates file
    rlt2t annotate load --sources data.jsonl [--policy-url URL] [--limit N]   # ... or sampled on a policy server
    rlt2t annotate serve [--host H] [--port P] [--candidates FILE]         # the web app
    rlt2t annotate terminal --annotator NAME [--sources FILE [--policy-url URL]]   # the terminal loop
    rlt2t annotate export [--out DIR] [--annotator NAME] [--include-flagged]   # ranks.tsv, pairs.jsonl, ratings.jsonl
    rlt2t annotate agreement                                               # Kendall's τ between annotators

All of them use ``annotate.database_url`` (SQLite under the run directory unless set), migrated on open.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from rlt2t.cmd_common import load_cfg

log = logging.getLogger("rlt2t.annotate")


def _load_items(cfg, store, *, candidates: str | None = None, sources: str | None = None,
                policy_url: str | None = None, limit: int | None = None) -> None:
    """Add items from a candidates file or sampled from a policy server; prints what was added."""
    from rlt2t.services.annotation.items import read_candidates, sample_items

    a = cfg.annotate
    if candidates is not None:
        new = list(read_candidates(candidates, max_candidates=a.max_candidates_per_item, max_chars=a.max_text_chars))
        origin = candidates
    elif sources is not None:
        from rlt2t.common.data import load_data
        from rlt2t.services.client import PolicyClient
        from rlt2t.services.http import load_token

        examples = list(load_data(sources, cfg.data, require_target=False))  # any format, the run's column names
        url = policy_url or a.policy_url
        with PolicyClient(url, token=load_token(cfg.serve)) as client:
            # Sampling a source again on the same policy would only queue it twice: a second load of the same file
            # adds nothing, as for a candidates file, and --limit counts the sources not queued yet. A new policy
            # version (the next round of the loop) samples them all again.
            version = client.model().version
            queued = store.queued_sources([e.source for e in examples], policy_version=version)
            if queued:
                examples = [e for e in examples if e.source not in queued]
                print(f"annotate: {len(queued)} sources of {sources} already have items of policy version {version}: "
                      "not sampled again", flush=True)
            new = sample_items(client, examples[:limit], num_candidates=a.num_candidates, top_k=a.top_k,
                               temperature=a.temperature, max_new_tokens=a.max_new_tokens, progress=cfg.run.progress)
        origin = f"{sources} sampled on {url}"
    else:
        raise ValueError("annotate: give --candidates FILE or --sources FILE")
    new = _rankable(cfg, new)
    added, known = store.add_items(new)
    print(f"annotate: {added} items added from {origin} ({known} already present); {store.count_items()} in all",
          flush=True)


def _rankable(cfg, new: list) -> list:
    """``new`` without the items that cannot be ranked or trained on (``items.rankable``), their texts checked
    with the run's tokenizer when it has one (the default reward model starts from the run's SFT checkpoint);
    what is left out is counted, with the first reason."""
    from rlt2t.common.tokenization import load_tokenizer, text_checker
    from rlt2t.jobs import text_tokenizer_dir
    from rlt2t.services.annotation.items import rankable

    where = text_tokenizer_dir(cfg)
    kept, skipped, first = rankable(new, text_checker(load_tokenizer(where)) if where is not None else None)
    if skipped:
        print(f"annotate: {skipped} items left out, which cannot be ranked or trained on (first: {first})",
              flush=True)
    return kept


def _check_source_args(args) -> None:
    if args.candidates and args.sources:
        raise ValueError("give --candidates or --sources, not both")


def cmd_add_user(args) -> None:
    from rlt2t.common.io import atomic_write_text
    from rlt2t.services.annotation.store import open_store

    cfg = load_cfg(args)
    store = open_store(cfg)
    try:
        token = store.reset_token(args.name) if args.reset else store.add_annotator(
            args.name, "admin" if args.admin else "annotator")
    finally:
        store.close()
    if args.token_file:
        atomic_write_text(args.token_file, token + "\n", private=True)  # owner-only before it has a name
        print(f"annotate: token of {args.name} written to {args.token_file}")
    else:
        print(token)


def cmd_load(args) -> None:
    from rlt2t.services.annotation.store import open_store

    _check_source_args(args)
    if not args.candidates and not args.sources:
        raise ValueError("give --candidates FILE.jsonl or --sources FILE.jsonl (sampled on --policy-url)")
    cfg = load_cfg(args)
    store = open_store(cfg)
    try:
        _load_items(cfg, store, candidates=args.candidates, sources=args.sources, policy_url=args.policy_url,
                    limit=args.limit)
    finally:
        store.close()


def cmd_serve(args) -> None:
    from rlt2t.cmd_serve import run_server
    from rlt2t.services.annotation.app import create_app
    from rlt2t.services.annotation.store import open_store

    cfg = load_cfg(args)
    host = args.host or cfg.annotate.host
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        log.warning("annotate: listening on %s beyond this machine: tokens and cookies travel in clear text unless a "
                    "TLS proxy is in front (then set annotate.secure_cookies=true)", host)
    store = open_store(cfg)
    if args.candidates:
        _load_items(cfg, store, candidates=args.candidates)
    if store.count_items() == 0:
        log.warning("annotate: the database has no items yet: add some with `rlt2t annotate load`")
    if not any(s.role == "admin" for s in store.annotator_stats()):
        log.warning("annotate: no admin yet: `rlt2t annotate add-user NAME --admin` prints one's token")
    app = create_app(cfg, store)
    try:
        run_server(app, host, cfg.annotate.port if args.port is None else args.port, "annotation")
    finally:
        store.close()


def cmd_terminal(args) -> None:
    from rlt2t.services.annotation.store import open_store
    from rlt2t.services.annotation.terminal import run_terminal

    if sys.stdin.isatty():
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401 - line editing for input() on a terminal

    cfg = load_cfg(args)
    a = cfg.annotate
    store = open_store(cfg)
    try:
        _check_source_args(args)
        if args.candidates or args.sources:
            _load_items(cfg, store, candidates=args.candidates, sources=args.sources, policy_url=args.policy_url,
                        limit=args.limit)
        if store.count_items() == 0:
            raise ValueError("annotate: no items to rate in this run's annotation database yet: load some with "
                             "`rlt2t annotate load --candidates FILE` (or --sources FILE --policy-url URL), or pass "
                             "--candidates / --sources here")
        annotator = store.annotator_by_name(args.annotator)
        if annotator is None:
            token = store.add_annotator(args.annotator)
            annotator = store.annotator_by_name(args.annotator)
            assert annotator is not None, "added just now"
            print(f"annotate: new annotator {args.annotator}; their token for the web app: {token}")
        result = run_terminal(store, annotator, rating_range=(a.rating_min, a.rating_max),
                              shuffle=a.shuffle_candidates, max_per_item=a.max_annotators_per_item,
                              read=input, write=lambda line: print(line, flush=True))
        progress = store.progress(annotator, a.max_annotators_per_item)
    finally:
        store.close()
    print(f"annotate: {result.rated} ratings stored this run; {args.annotator}: done {progress.done}, "
          f"left {progress.left}", flush=True)


def cmd_export(args) -> None:
    from rlt2t.services.annotation.export import FILES, export_all
    from rlt2t.services.annotation.store import open_store

    cfg = load_cfg(args)
    out = Path(args.out) if args.out else cfg.run_dir / "annotate" / "export"
    store = open_store(cfg)
    try:
        counts = export_all(store, out, include_flagged=args.include_flagged or cfg.annotate.include_flagged,
                            annotator=args.annotator)
    finally:
        store.close()
    dropped = [f"{n} {what}" for n, what in ((counts.dropped_candidates, "blank or repeated candidates"),
                                             (counts.dropped_lists, "rankings left with < 2"))
               if n]
    print(f"{out / FILES['ranks']}: {counts.rank_lists} rank lists"
          + (f" ({counts.cleaned} texts had tabs or line breaks, now spaces)" if counts.cleaned else "")
          + (f"; left out: {', '.join(dropped)}" if dropped else ""))
    print(f"{out / FILES['pairs']}: {counts.pairs} pairs")
    print(f"{out / FILES['ratings']}: {counts.ratings} ratings"
          + (f" ({counts.merged_ratings} more averaged in: one row per source and candidate)"
             if counts.merged_ratings else "")
          + (f"; left out: {counts.dropped_ratings} of blank texts" if counts.dropped_ratings else ""))


def cmd_agreement(args) -> None:
    from rlt2t.services.annotation.agreement import agreement
    from rlt2t.services.annotation.store import open_store

    cfg = load_cfg(args)
    store = open_store(cfg)
    try:
        report = agreement(store.judgements())
    finally:
        store.close()
    if not report.pairs:
        print("agreement: no item was judged completely by two annotators yet")
        return
    print("Kendall's τ-b between annotators on shared items")
    for p in report.pairs:
        tau = f"{p.mean_tau:+.4f}" if p.mean_tau is not None else "undefined"
        print(f"  {p.annotator_a} / {p.annotator_b}: mean τ {tau} over {p.items} items"
              + (f" ({p.undefined} more with a constant judgement)" if p.undefined else ""))
    if report.mean_tau is not None:
        print(f"mean τ over {report.comparisons} comparisons: {report.mean_tau:+.4f}")


def register(sub: argparse._SubParsersAction, config_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add this module's subcommands to the `rlt2t` parser; `config_args` adds --config and overrides."""
    annotate = sub.add_parser("annotate", help="human annotation: web app, terminal loop, exports for reward models"
                              ).add_subparsers(dest="annotate_command", required=True, metavar="subcommand")

    p = annotate.add_parser("add-user", help="create an annotator and print their token (shown once)")
    p.add_argument("name", help="annotator name (no spaces)")  # before the overrides: both are positional
    config_args(p)
    p.add_argument("--admin", action="store_true", help="may see everyone's work, agreement and exports")
    p.add_argument("--reset", action="store_true", help="give an existing annotator a new token (old one revoked)")
    p.add_argument("--token-file", default=None, help="write the token to this file (mode 600) instead of stdout")
    p.set_defaults(fn=cmd_add_user)

    def item_sources(p: argparse.ArgumentParser) -> None:
        p.add_argument("--candidates", default=None, metavar="FILE",
                       help="candidates JSONL: {id?, source, candidates: [text | {text}]} per line "
                            "(rlt2t predict's .candidates.jsonl loads as it is)")
        p.add_argument("--sources", default=None, metavar="FILE",
                       help="data JSONL (id, source): annotate.num_candidates candidates per source are sampled "
                            "on the policy server")
        p.add_argument("--policy-url", default=None, help="policy server (default: annotate.policy_url)")
        p.add_argument("--limit", type=int, default=None, help="use only the first N sources")

    p = annotate.add_parser("load", help="add items: a candidates file, or sources sampled on a policy server")
    config_args(p)
    item_sources(p)
    p.set_defaults(fn=cmd_load)

    p = annotate.add_parser("serve", help="the annotation web app (binds annotate.host, 127.0.0.1)")
    config_args(p)
    p.add_argument("--host", default=None, help="bind address (default: annotate.host)")
    p.add_argument("--port", type=int, default=None, help="port (default: annotate.port; 0: any free port)")
    p.add_argument("--candidates", default=None, metavar="FILE", help="load this candidates JSONL first")
    p.set_defaults(fn=cmd_serve)

    p = annotate.add_parser("terminal", help='rate results in the terminal ("Reward (-2.0 ~ 2.0):")')
    config_args(p)
    p.add_argument("--annotator", required=True, help="whose ratings these are (created when new)")
    item_sources(p)
    p.set_defaults(fn=cmd_terminal)

    p = annotate.add_parser("export", help="ranks.tsv, pairs.jsonl and ratings.jsonl for reward-model training")
    config_args(p)
    p.add_argument("--out", default=None, help="output directory (default: {run}/annotate/export)")
    p.add_argument("--annotator", default=None, help="only this annotator's work")
    p.add_argument("--include-flagged", action="store_true", help="include flagged annotations (default: "
                                                                  "annotate.include_flagged)")
    p.set_defaults(fn=cmd_export)

    p = annotate.add_parser("agreement", help="Kendall's τ-b between annotators on the items they share")
    config_args(p)
    p.set_defaults(fn=cmd_agreement)
