"""Annotation web app under concurrent annotators, on loopback: latency, errors, and nothing lost or doubled.

    python bench/annotate_load.py [--annotators 20] [--seconds 20] [--items 1000] [--database URL]

Prepares a database (SQLite in a temporary run directory by default; or --database, e.g. an empty
PostgreSQL database's URL) holding --items items of 4 candidates and --annotators annotators, then starts
`rlt2t annotate serve --port 0` in a subprocess (the URL read from its `serving annotation on ...` line).
Each annotator is an async httpx client with one connection and its own bearer token, working back to back
(no think time: a load far above people's) for --seconds:

    GET /api/next  ->  POST /api/submissions (a random ranking of the 4 candidates; every 10th item a skip)

and every 7th submission is sent twice with the same submission id (a double submit: the second answer must
say `duplicate`). Reported per route: requests/s, p50 / p99 / max latency in ms, every status and transport
error (target: nothing but 200). Afterwards the database is checked: each annotator holds exactly one
annotation per acknowledged submission and the submissions table exactly the acknowledged ids (nothing lost,
nothing duplicated). The server is stopped with SIGTERM (killed after 30 s). Saves
bench/results/annotate_load.json with the machine description. Timings need a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from sqlalchemy import func, select

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_server import CliServer  # noqa: E402
from machine_info import save  # noqa: E402

from rlt2t.services.annotation.store import NewItem, Store  # noqa: E402
from rlt2t.services.annotation.tables import annotations, submissions  # noqa: E402

CANDIDATES = 4
SKIP_EVERY, DOUBLE_EVERY = 10, 7


def prepare(url: str, items: int, annotators: int) -> dict[str, str]:
    """Items and annotators in the database at ``url``; annotator name -> bearer token."""
    rng = random.Random(0)
    store = Store.open(url)
    try:
        if store.count_items():
            raise SystemExit(f"{store.url} holds items already: give an empty database")
        store.add_items([NewItem(" ".join(str(rng.randrange(1894)) for _ in range(24)),
                                 tuple(" ".join(str(rng.randrange(1894)) for _ in range(12))
                                       for _ in range(CANDIDATES)),
                                 origin="bench") for _ in range(items)])
        return {f"annotator{i:02d}": store.add_annotator(f"annotator{i:02d}") for i in range(annotators)}
    finally:
        store.close()


def start_server(run_dir: Path, database: str) -> CliServer:
    """`rlt2t annotate serve` on a free loopback port."""
    return CliServer(["annotate", "serve", "--port", "0", f"run.dir={run_dir}", f"annotate.database_url={database}"],
                     "serving annotation on ")


async def load(url: str, tokens: dict[str, str], seconds: float) -> dict[str, Any]:
    """Every annotator works its queue for ``seconds``; latencies, statuses and acknowledged submissions."""
    latency: dict[str, list[float]] = {"next": [], "submit": []}
    statuses: Counter[str] = Counter()
    acked: dict[str, set[str]] = {name: set() for name in tokens}
    doubles = Counter()
    deadline = time.monotonic() + seconds

    async def timed(route: str, request) -> httpx.Response | None:
        start = time.perf_counter()
        try:
            response = await request
        except httpx.HTTPError as e:
            statuses[f"{route} {type(e).__name__}"] += 1
            return None
        statuses[f"{route} {response.status_code}"] += 1
        if response.status_code == 200:
            latency[route].append(time.perf_counter() - start)
        return response

    async def annotator(name: str, token: str, seed: int) -> None:
        rng = random.Random(seed)
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60.0,
                                     limits=httpx.Limits(max_connections=1)) as http:
            done = 0
            while time.monotonic() < deadline:
                r = await timed("next", http.get("/api/next"))
                if r is None or r.status_code != 200:
                    await asyncio.sleep(0.05)
                    continue
                item = r.json()["item"]
                if item is None:
                    statuses["queue empty"] += 1
                    return
                done += 1
                body: dict[str, Any] = {"submission_id": uuid.uuid4().hex, "item_id": item["item_id"]}
                if done % SKIP_EVERY == 0:
                    body["action"] = "skip"
                else:
                    order = [c["id"] for c in item["candidates"]]
                    rng.shuffle(order)
                    body.update(action="rank", order=order)
                for attempt in range(2 if done % DOUBLE_EVERY == 0 else 1):
                    r = await timed("submit", http.post("/api/submissions", json=body))
                    if r is not None and r.status_code == 200:
                        acked[name].add(body["submission_id"])
                        if attempt == 1:
                            doubles["answered duplicate" if r.json()["duplicate"] else "applied twice"] += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(annotator(name, token, i) for i, (name, token) in enumerate(tokens.items())))
    wall = time.perf_counter() - t0
    routes = {}
    for route, values in latency.items():
        ms = np.array(values) * 1000 if values else np.array([float("nan")])
        routes[route] = {"ok": len(values), "requests_per_s": len(values) / wall,
                         "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
                         "max_ms": float(ms.max())}
    return {"wall_s": wall, "routes": routes, "statuses": dict(statuses), "double_submits": dict(doubles),
            "acked": {name: sorted(ids) for name, ids in acked.items()}}


def integrity(url: str, acked: dict[str, list[str]]) -> dict[str, Any]:
    """Nothing lost, nothing doubled: the database against what the clients were told."""
    store = Store.open(url)
    try:
        with store.read() as conn:
            stored = set(conn.execute(select(submissions.c.id)).scalars())
            per_annotator = {}
            for name in acked:
                who = store.annotator_by_name(name)
                per_annotator[name] = conn.execute(select(func.count()).select_from(annotations)
                                                   .where(annotations.c.annotator_id == who.id)).scalar_one()
    finally:
        store.close()
    told = {sid for ids in acked.values() for sid in ids}
    return {"acknowledged": len(told), "stored": len(stored), "lost": len(told - stored),
            "unacknowledged_but_stored": len(stored - told),
            "annotations_match": all(per_annotator[n] == len(ids) for n, ids in acked.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--annotators", type=int, default=20, help="concurrent annotators")
    ap.add_argument("--seconds", type=float, default=20.0, help="duration of the load")
    ap.add_argument("--items", type=int, default=1000, help="items in the database (each annotator's queue)")
    ap.add_argument("--database", default=None, help="an empty database's SQLAlchemy URL (default: SQLite in a "
                                                     "temporary run directory)")
    ap.add_argument("--no-save", action="store_true", help="print only; leave bench/results/ alone")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlt2t-annotate-load-") as tmp:
        url = args.database or f"sqlite:///{tmp}/annotate/annotations.db"
        tokens = prepare(url, args.items, args.annotators)
        server = start_server(Path(tmp), url)
        try:
            result = asyncio.run(load(server.url, tokens, args.seconds))
        finally:
            server.stop()
        check = integrity(url, result.pop("acked"))
        backend = url.split(":", 1)[0]

    errors = {k: v for k, v in result["statuses"].items() if not k.endswith(" 200") and k != "queue empty"}
    print(f"\n{args.annotators} annotators, {result['wall_s']:.1f} s, {backend}")
    print(f"{'route':<8} {'ok':>7} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for route, r in result["routes"].items():
        print(f"{route:<8} {r['ok']:>7} {r['requests_per_s']:>8.1f} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} "
              f"{r['max_ms']:>8.1f}")
    print(f"errors: {errors or 'none'}; double submits: {result['double_submits']}")
    print(f"database: {check}")
    payload = {"annotators": args.annotators, "seconds": args.seconds, "items": args.items, "database": backend,
               "candidates_per_item": CANDIDATES, **result, "errors": errors, "integrity": check,
               "no_errors": not errors and check["lost"] == 0 and check["unacknowledged_but_stored"] == 0
               and check["annotations_match"] and "applied twice" not in result["double_submits"]}
    if not args.no_save:
        print("saved", save("annotate_load", payload))


if __name__ == "__main__":
    main()
