"""Policy server under load, on loopback: does request batching pay, does overload stay graceful, and do
small requests keep their latency next to a client sending maximum-cost requests?

    python bench/serve_load.py [--seconds 15] [--clients 32] [--checkpoint DIR] [--phases batching,mixed,maxcost]

Starts `rlt2t serve policy` in a subprocess on 127.0.0.1 (port 0; the URL is read from its
`serving policy on ...` line) serving a `small`-preset policy (weights from scratch, seed 0, saved as
a model directory; or --checkpoint). Async httpx clients, each with one connection, post
/v1/candidates (one 24-token synthetic source, one sample, top-k 3, 16 new tokens) back to back.

Every request decodes exactly 16 tokens: the from-scratch model gets a -1e4 logit bias on EOS (what
serving benchmarks call "ignore EOS"). Left alone it samples EOS after about 3 tokens on average, the
load is then mostly HTTP overhead and no longer the stated one; `--natural-eos` measures that load.
A --checkpoint is served as it is.

The phases:

  batched   --clients clients for --seconds, serve.max_batch_size=32, serve.max_wait_ms=5;
  batch 1   the same load on a server with serve.max_batch_size=1 (every request its own model call);
  overload  2 x --clients clients against the batched server, whose serve.max_queue_cost is --clients
            small requests' work: only 200 and 503 (+ Retry-After) may come back; a client that gets a
            503 waits 50 ms and tries again. The server's RSS is sampled (psutil) throughout.

and the mixed load (#18), on a server with the default work limits (serve.max_request_cost,
serve.max_call_cost) and room in its queue for a maximum-cost request:

  small     --clients - 1 clients of the small request above, alone;
  mixed     the same clients plus one client posting maximum-cost requests back to back: as many
            sources x candidates as serve.max_request_cost allows at --big-new-tokens new tokens
            (64 sources x 9 candidates x (24 + 200) by default), within the per-request limits.

and the maximum-cost client (#42), on a server with the default limits: one request of the most work each of
the request limits allows, on the longest texts the model takes (8 sources of 255 tokens x 32 samples x 255
new tokens for the `small` preset within serve.max_request_cost), at temperature 100 with no top-k so that no
row stops early:

  small         --clients - 1 small clients, alone;
  max alone     the maximum-cost request alone, once: refused at once naming the limit (429), or answered
                within serve.request_timeout_s;
  max mixed     the small clients, joined after 12 s by one client posting the maximum-cost request back to
                back (50 ms after each refusal); the small requests of the --seconds after it joined are measured;
  max served    the same on a server with serve.request_timeout_s = --long-timeout, where the maximum-cost
                request is admitted and runs beside the small ones (how fairly they share).

Reported: requests/s and p50/p99 latency of each phase, the batched/batch-1 throughput ratio (target >= 4x),
the model-only ceiling of that ratio (the server's backend called in this process with no HTTP: sources/s at 1
source per call vs --clients sources per call, same decoding settings), the overload status counts (target:
nothing but 200 and 503) and the server RSS before, max and after (target: bounded); for the mixed load, the
small requests' p50 / p99 alone and next to the maximum-cost client (target: mixed p99 within 2x of alone) and
what the big client got. The servers are stopped with SIGTERM (killed if they do not exit in 30 s) and
everything ends by itself. Saves bench/results/serve_load.json with the machine description
(serve_load_mixed.json when only the mixed phases run, serve_load_maxcost.json when only the maximum-cost
ones do), each phase with the 1-, 5- and 15-minute load averages at its start and end (another job on the
cores changes every timing).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_server import CliServer  # noqa: E402
from machine_info import save  # noqa: E402

from rlt2t.common.config import ModelConfig, ServeConfig  # noqa: E402
from rlt2t.common.io import atomic_directory  # noqa: E402
from rlt2t.common.policy import load_policy  # noqa: E402
from rlt2t.common.tokenization import build_ids_tokenizer, save_tokenizer  # noqa: E402

SPEEDUP_TARGET = 4.0
MIXED_TARGET = 2.0
BIG_AFTER_S = 12.0
"""The maximum-cost client starts this long after the small ones (the server's memory of recent load is 10 s)."""
SOURCE_TOKENS = 24
REQUEST = {"num_candidates": 1, "top_k": 3, "temperature": 0.8, "max_new_tokens": 16}
SMALL_COST = REQUEST["num_candidates"] * (SOURCE_TOKENS + REQUEST["max_new_tokens"])  # the server's estimate


def max_cost_request(serve: ServeConfig, positions: int, seed: int = 1) -> dict[str, Any]:
    """The issue's probe: the longest sources and outputs the model takes, the most samples per source, as many
    sources as serve.max_request_cost then allows; temperature 100 and no top-k, so that no row stops early."""
    length = min(serve.max_tokens_per_source, positions - 1)
    new_tokens = positions - 1
    k = serve.max_candidates_per_source
    n = max(1, min(serve.max_sources_per_call, serve.max_request_cost // (k * (length + new_tokens))))
    rng = random.Random(seed)
    texts = [" ".join(str(rng.randrange(1894)) for _ in range(length)) for _ in range(n)]
    return {"sources": texts, "num_candidates": k, "top_k": 0, "temperature": 100.0, "max_new_tokens": new_tokens}


def big_request(texts: list[str], new_tokens: int, serve: ServeConfig) -> dict[str, Any]:
    """The most work one request may ask for at ``new_tokens`` new tokens: as many rows (sources x
    candidates, within the per-request limits) as serve.max_request_cost allows."""
    rows = serve.max_request_cost // (SOURCE_TOKENS + new_tokens)
    n = min(serve.max_sources_per_call, rows)
    k = min(serve.max_candidates_per_source, rows // n)
    return {"sources": texts[:n], "num_candidates": k, "top_k": 3, "temperature": 0.8, "max_new_tokens": new_tokens}


def prepare(workdir: Path, *, natural_eos: bool = False) -> Path:
    """A from-scratch `small` policy (seed 0) with its tokenizer, saved as a model directory; EOS is
    suppressed unless ``natural_eos`` (see the module docstring)."""
    tok_dir, model_dir = workdir / "tokenizer", workdir / "model"
    with atomic_directory(tok_dir) as tmp:
        save_tokenizer(build_ids_tokenizer(1894), tmp)
    policy = load_policy(ModelConfig(preset="small", dropout=0.0), tok_dir, seed=0)
    if not natural_eos:
        # Every row decodes to max_new_tokens (whose last token is the forced EOS): a known 16 steps.
        with torch.no_grad():
            policy.model.final_logits_bias[0, policy.tokenizer.eos_token_id] = -1e4
    with atomic_directory(model_dir) as tmp:
        policy.model.save_pretrained(tmp)
        save_tokenizer(policy.tokenizer, tmp)
    return model_dir


class Server(CliServer):
    """`rlt2t serve policy` on a free loopback port, with its resident memory."""

    def __init__(self, model_dir: Path, workdir: Path, overrides: list[str]) -> None:
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        env.pop("RLT2T_API_TOKEN", None)
        super().__init__(["serve", "policy", "--checkpoint-dir", str(model_dir), "--port", "0", f"run.dir={workdir}",
                          "model.preset=small", *overrides], "serving policy on ", env)
        self.ps = psutil.Process(self.proc.pid)
        # The socket listens before the app has started (it calibrates its speed first): wait for that.
        httpx.get(f"{self.url}/readyz", timeout=600.0).raise_for_status()

    def rss_mib(self) -> float:
        return self.ps.memory_info().rss / 2**20


def model_ceiling(model_dir: Path, workdir: Path, batch: int, texts: list[str], repeats: int = 3) -> dict[str, float]:
    """Sources/s of the backend alone at 1 and ``batch`` sources per call: no server can batch better."""
    from rlt2t.common.config import load_config
    from rlt2t.services.backends import Sampling, TorchBackend

    cfg = load_config([], [f"run.dir={workdir}", "model.preset=small", "serve.device=cpu"])
    backend = TorchBackend.from_checkpoint(cfg, model_dir)
    sampling = Sampling(mode="sample", num_candidates=REQUEST["num_candidates"], top_k=REQUEST["top_k"],
                        temperature=REQUEST["temperature"], beam_size=1, max_new_tokens=REQUEST["max_new_tokens"])
    rate, tokens = {}, []
    for n in (1, batch):
        backend.candidates(texts[:n], sampling, list(range(n)))  # warm-up
        calls = repeats * (batch // n if n == 1 else 1)
        t0 = time.perf_counter()
        for r in range(calls):  # a different source and seed per row, as the server sees them
            first = (r * n) % (len(texts) - n)
            out = backend.candidates(texts[first : first + n], sampling, list(range(first, first + n)))
            tokens += [len(gens[0].token_ids) for gens in out]
        rate[n] = calls * n / (time.perf_counter() - t0)
    return {"sources_per_s_1": rate[1], f"sources_per_s_{batch}": rate[batch], "ratio": rate[batch] / rate[1],
            "mean_tokens_per_source": float(np.mean(tokens))}


def sources(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(str(rng.randrange(1894)) for _ in range(SOURCE_TOKENS)) for _ in range(n)]


def phase_line(name: str, p: dict[str, Any], width: int, tail: str) -> str:
    """One printed row of a load phase: requests/s and p50/p99 latency, then ``tail``."""
    return (f"  {name:<{width}} {p['requests_per_s']:>8.1f} req/s  p50 {p['p50_ms']:>6.0f} ms  "
            f"p99 {p['p99_ms']:>6.0f} ms  {tail}")


async def big_client(url: str, body: dict[str, Any], out: dict[str, Any]) -> None:
    """Posts ``body`` back to back until cancelled (then its connection closes: the server drops the job)."""
    out.update(statuses=Counter(), latencies_s=[], refused_ms=[], detail=None)
    async with httpx.AsyncClient(base_url=url, timeout=1800.0, limits=httpx.Limits(max_connections=1)) as http:
        while True:
            start = time.perf_counter()
            try:
                r = await http.post("/v1/candidates", json=body)
            except httpx.HTTPError as e:
                out["statuses"][type(e).__name__] += 1
                continue
            out["statuses"][str(r.status_code)] += 1
            if r.status_code == 200:
                out["latencies_s"].append(time.perf_counter() - start)
            else:
                out["refused_ms"].append((time.perf_counter() - start) * 1000)
                out["detail"] = r.json().get("detail") if r.headers.get("content-type") == "application/json" else None
                await asyncio.sleep(0.05)


async def load(url: str, clients: int, seconds: float, texts: list[str],
               big: dict[str, Any] | None = None, big_after_s: float | None = None) -> dict[str, Any]:
    """``clients`` loops posting one request after another for ``seconds``; status counts and latencies.
    With ``big``, one more client posts that body back to back meanwhile (reported under "big"): from the start
    (the small clients 0.5 s later), or ``big_after_s`` seconds after the small clients (what the server saw of
    them lately is then their load; only the small requests sent after the big client started are measured)."""
    statuses: Counter[str] = Counter()
    latencies: list[float] = []
    retry_after_missing = 0
    big_out: dict[str, Any] = {}
    big_task: asyncio.Future | None = None
    measure_from = time.perf_counter()
    if big is not None and big_after_s is None:
        big_task = asyncio.ensure_future(big_client(url, big, big_out))
        await asyncio.sleep(0.5)  # the big request is in the model before the measured load starts
        measure_from = time.perf_counter()
    elif big is not None:
        measure_from += big_after_s

        async def late_big() -> None:
            await asyncio.sleep(big_after_s)
            await big_client(url, big, big_out)

        big_task = asyncio.ensure_future(late_big())
    deadline = time.monotonic() + (measure_from - time.perf_counter()) + seconds

    async def client(i: int) -> None:
        nonlocal retry_after_missing
        async with httpx.AsyncClient(base_url=url, timeout=60.0, limits=httpx.Limits(max_connections=1)) as http:
            k = i
            while time.monotonic() < deadline:
                start = time.perf_counter()
                try:
                    r = await http.post("/v1/candidates", json={"sources": [texts[k % len(texts)]], **REQUEST})
                except httpx.HTTPError as e:
                    statuses[type(e).__name__] += 1
                    continue
                if start < measure_from:
                    k += clients
                    continue
                statuses[str(r.status_code)] += 1
                if r.status_code == 200:
                    latencies.append(time.perf_counter() - start)
                    k += clients
                elif r.status_code == 503:
                    retry_after_missing += "Retry-After" not in r.headers
                    await asyncio.sleep(0.05)

    await asyncio.gather(*(client(i) for i in range(clients)))
    wall = time.perf_counter() - measure_from
    if big_task is not None:
        big_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await big_task
    lat = np.array(latencies) if latencies else np.array([float("nan")])
    result = {"clients": clients, "wall_s": wall, "ok": len(latencies), "requests_per_s": len(latencies) / wall,
              "p50_ms": float(np.percentile(lat, 50) * 1000), "p99_ms": float(np.percentile(lat, 99) * 1000),
              "statuses": dict(statuses), "retry_after_missing": retry_after_missing}
    if big is not None:
        refused = big_out["refused_ms"]
        result["big"] = {"requests_ok": len(big_out["latencies_s"]), "statuses": dict(big_out["statuses"]),
                         "latencies_s": big_out["latencies_s"], "last_refusal": big_out["detail"],
                         "refusal_p50_ms": float(np.percentile(refused, 50)) if refused else None,
                         "refusal_max_ms": max(refused, default=None)}
    return result


def sampled_rss(server: Server, stop: threading.Event, out: list[float]) -> None:
    while not stop.wait(0.25):
        try:
            out.append(server.rss_mib())
        except psutil.Error:
            return


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_phase(server: Server, clients: int, seconds: float, texts: list[str], rss: list[float],
              big: dict[str, Any] | None = None, big_after_s: float | None = None) -> dict[str, Any]:
    stop = threading.Event()
    sampler = threading.Thread(target=sampled_rss, args=(server, stop, rss), daemon=True)
    sampler.start()
    start_load = load_average()
    try:
        result = asyncio.run(load(server.url, clients, seconds, texts, big, big_after_s))
    finally:
        stop.set()
        sampler.join()
    return {**result, "loadavg_start": start_load, "loadavg_end": load_average()}


def batching_phases(model_dir: Path, work: Path, args, texts: list[str]) -> dict[str, Any]:
    """batched, overload and batch 1, the model-only ceiling; the RSS of the batched server."""
    phases: dict[str, Any] = {}
    rss: dict[str, list[float]] = {}
    batched = Server(model_dir, work, ["serve.max_batch_size=32", "serve.max_wait_ms=5",
                                       f"serve.max_queue_cost={args.clients * SMALL_COST}"])
    try:
        warm = asyncio.run(load(batched.url, 4, 2.0, texts))  # first calls allocate; not measured
        rss_before = batched.rss_mib()
        rss["batched"] = []
        phases["batched"] = run_phase(batched, args.clients, args.seconds, texts, rss["batched"])
        print(f"batched: {phases['batched']['requests_per_s']:.1f} req/s", flush=True)
        rss["overload"] = []
        phases["overload"] = run_phase(batched, 2 * args.clients, args.seconds, texts, rss["overload"])
        print(f"overload: {phases['overload']['statuses']}", flush=True)
        rss_after = batched.rss_mib()
    finally:
        batched.stop()

    single = Server(model_dir, work, ["serve.max_batch_size=1", "serve.max_wait_ms=0",
                                      f"serve.max_queue_cost={1024 * SMALL_COST}"])
    try:
        asyncio.run(load(single.url, 4, 2.0, texts))
        rss["batch1"] = []
        phases["batch1"] = run_phase(single, args.clients, args.seconds, texts, rss["batch1"])
        print(f"batch 1: {phases['batch1']['requests_per_s']:.1f} req/s", flush=True)
    finally:
        single.stop()

    ceiling = model_ceiling(model_dir, work, args.clients, texts)
    print(f"model only: {ceiling['sources_per_s_1']:.1f} sources/s one at a time, "
          f"{ceiling[f'sources_per_s_{args.clients}']:.1f} in calls of {args.clients}: "
          f"ceiling {ceiling['ratio']:.2f}x ({ceiling['mean_tokens_per_source']:.1f} tokens per source)", flush=True)
    speedup = phases["batched"]["requests_per_s"] / max(phases["batch1"]["requests_per_s"], 1e-9)
    over = phases["overload"]["statuses"]
    return {"warmup": warm["statuses"], "phases": phases, "speedup": speedup, "speedup_target": SPEEDUP_TARGET,
            "model_only": ceiling, "overload_only_200_503": set(over) <= {"200", "503"},
            "rss_mib": {"before": rss_before, "max": max(rss["batched"] + rss["overload"], default=float("nan")),
                        "after": rss_after}}


def mixed_phases(model_dir: Path, work: Path, args, texts: list[str]) -> dict[str, Any]:
    """Small requests alone, then next to one client of maximum-cost requests (default work limits)."""
    serve = ServeConfig()
    big = big_request(texts, args.big_new_tokens, serve)
    small_clients = args.clients - 1
    server = Server(model_dir, work, ["serve.max_batch_size=32", "serve.max_wait_ms=5",
                                      f"serve.max_queue_cost={2 * serve.max_request_cost}"])
    rss: list[float] = []
    try:
        asyncio.run(load(server.url, 4, 2.0, texts))  # warm-up
        alone = run_phase(server, small_clients, args.seconds, texts, rss)
        print(f"small alone: p50 {alone['p50_ms']:.0f} ms, p99 {alone['p99_ms']:.0f} ms", flush=True)
        mixed = run_phase(server, small_clients, args.seconds, texts, rss, big=big)
        print(f"small + max-cost client: p50 {mixed['p50_ms']:.0f} ms, p99 {mixed['p99_ms']:.0f} ms; big client "
              f"{mixed['big']['statuses']}", flush=True)
    finally:
        server.stop()
    ratio = mixed["p99_ms"] / alone["p99_ms"]
    cost = len(big["sources"]) * big["num_candidates"] * (SOURCE_TOKENS + big["max_new_tokens"])
    return {"big_request": {k: v for k, v in big.items() if k != "sources"} | {"num_sources": len(big["sources"]),
                                                                              "cost": cost},
            "limits": {"max_request_cost": serve.max_request_cost, "max_call_cost": serve.max_call_cost},
            "small_alone": alone, "mixed": mixed, "p99_ratio": ratio, "p99_ratio_target": MIXED_TARGET,
            "rss_mib_max": max(rss, default=float("nan"))}


def post_once(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One request alone: status, seconds to the answer, the refusal's body."""
    start_load = load_average()
    start = time.perf_counter()
    with httpx.Client(base_url=url, timeout=1800.0) as http:
        r = http.post("/v1/candidates", json=body)
    seconds = time.perf_counter() - start
    refusal = r.json() if r.status_code != 200 else None
    return {"status": r.status_code, "seconds": seconds, "refusal": refusal, "loadavg_start": start_load,
            "loadavg_end": load_average()}


def maxcost_phases(model_dir: Path, work: Path, args, texts: list[str], positions: int) -> dict[str, Any]:
    """Small requests alone, the maximum-cost request alone, and the two together: on a server with the default
    limits (refusals expected), then on one with serve.request_timeout_s = --long-timeout (admitted, shared)."""
    serve = ServeConfig()
    big = max_cost_request(serve, positions)
    small_clients = args.clients - 1
    rss: list[float] = []
    out: dict[str, Any] = {}
    server = Server(model_dir, work, ["serve.max_batch_size=32", "serve.max_wait_ms=5",
                                      f"serve.max_queue_cost={2 * serve.max_request_cost}"])
    try:
        asyncio.run(load(server.url, 4, 2.0, texts))  # warm-up
        out["small_alone"] = run_phase(server, small_clients, args.seconds, texts, rss)
        print(f"small alone: p50 {out['small_alone']['p50_ms']:.0f} ms, p99 {out['small_alone']['p99_ms']:.0f} ms",
              flush=True)
        time.sleep(BIG_AFTER_S)  # the server's memory of the small load fades: the request is alone
        out["max_alone"] = post_once(server.url, big)
        print(f"max-cost alone: {out['max_alone']['status']} in {out['max_alone']['seconds']:.2f} s "
              f"{out['max_alone']['refusal'] or ''}", flush=True)
        out["max_mixed"] = run_phase(server, small_clients, args.seconds, texts, rss, big=big,
                                     big_after_s=BIG_AFTER_S)
        print(f"small + max-cost client: p50 {out['max_mixed']['p50_ms']:.0f} ms, p99 "
              f"{out['max_mixed']['p99_ms']:.0f} ms; max-cost client {out['max_mixed']['big']['statuses']}", flush=True)
    finally:
        server.stop()
    served = Server(model_dir, work, ["serve.max_batch_size=32", "serve.max_wait_ms=5",
                                      f"serve.max_queue_cost={2 * serve.max_request_cost}",
                                      f"serve.request_timeout_s={args.long_timeout}"])
    try:
        asyncio.run(load(served.url, 4, 2.0, texts))
        out["small_alone_long_timeout"] = run_phase(served, small_clients, args.seconds, texts, rss)
        out["max_served"] = run_phase(served, small_clients, args.seconds, texts, rss, big=big,
                                      big_after_s=BIG_AFTER_S)
        print(f"small + admitted max-cost client: p50 {out['max_served']['p50_ms']:.0f} ms, p99 "
              f"{out['max_served']['p99_ms']:.0f} ms; max-cost client {out['max_served']['big']['statuses']}",
              flush=True)
    finally:
        served.stop()
    cost = len(big["sources"]) * big["num_candidates"] * (len(big["sources"][0].split()) + big["max_new_tokens"])
    alone = out["small_alone"]["p99_ms"]
    return {"max_cost_request": {k: v for k, v in big.items() if k != "sources"} | {
                "num_sources": len(big["sources"]), "source_tokens": len(big["sources"][0].split()), "cost": cost},
            "limits": {"max_request_cost": serve.max_request_cost, "max_call_cost": serve.max_call_cost,
                       "request_timeout_s": serve.request_timeout_s, "long_timeout_s": args.long_timeout},
            **out, "p99_ratio_refused": out["max_mixed"]["p99_ms"] / alone,
            "p99_ratio_served": out["max_served"]["p99_ms"] / out["small_alone_long_timeout"]["p99_ms"],
            "p99_ratio_target": MIXED_TARGET, "rss_mib_max": max(rss, default=float("nan"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=15.0, help="duration of each load phase")
    ap.add_argument("--clients", type=int, default=32,
                    help="concurrent clients (overload uses twice as many; the mixed load this many minus one "
                         "small clients plus the maximum-cost one)")
    ap.add_argument("--checkpoint", default=None, help="model/checkpoint directory (default: small preset, seed 0)")
    ap.add_argument("--natural-eos", action="store_true",
                    help="let the from-scratch model stop at its own EOS (about 3 tokens) instead of 16 tokens")
    ap.add_argument("--phases", default="batching,mixed",
                    help="comma-separated: batching (batched, overload, batch 1), mixed (small alone, with a "
                         "maximum-cost client at serve.max_request_cost), maxcost (small alone, with the client "
                         "of the longest texts and most samples at temperature 100; refused, then admitted)")
    ap.add_argument("--long-timeout", type=float, default=1800.0,
                    help="serve.request_timeout_s of the server where the maxcost phase's request is admitted")
    ap.add_argument("--big-new-tokens", type=int, default=200, help="max_new_tokens of the maximum-cost requests")
    ap.add_argument("--no-save", action="store_true", help="print only; leave bench/results/ alone")
    args = ap.parse_args()
    wanted = set(args.phases.split(","))
    if not wanted or not wanted <= {"batching", "mixed", "maxcost"}:
        ap.error(f"--phases: choose from batching, mixed, maxcost (got {args.phases!r})")
    texts = sources(512)
    payload: dict[str, Any] = {"request": REQUEST, "seconds": args.seconds,
                               "model": str(args.checkpoint or "preset:small, seed 0"),
                               "eos": "natural" if args.natural_eos or args.checkpoint else
                               "suppressed (16 tokens per request)"}
    with tempfile.TemporaryDirectory(prefix="rlt2t-serve-load-") as tmp:
        work = Path(tmp)
        model_dir = Path(args.checkpoint) if args.checkpoint else prepare(work, natural_eos=args.natural_eos)
        if "batching" in wanted:
            payload.update(batching_phases(model_dir, work, args, texts))
        if "mixed" in wanted:
            payload["mixed_load"] = mixed_phases(model_dir, work, args, texts)
        if "maxcost" in wanted:
            payload["maxcost_load"] = maxcost_phases(model_dir, work, args, texts, positions=256)

    if "batching" in wanted:
        phases, ceiling = payload["phases"], payload["model_only"]
        print(f"\n{'phase':<10} {'clients':>7} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8}  statuses")
        for name in ("batched", "batch1", "overload"):
            p = phases[name]
            print(f"{name:<10} {p['clients']:>7} {p['requests_per_s']:>8.1f} {p['p50_ms']:>8.0f} {p['p99_ms']:>8.0f}  "
                  f"{p['statuses']}")
        print(f"\nbatching speedup: {payload['speedup']:.2f}x (target >= {SPEEDUP_TARGET:.0f}x; the model alone "
              f"batches {ceiling['ratio']:.2f}x on this machine)")
        print(f"overload: only 200/503: {payload['overload_only_200_503']}; 503s without Retry-After: "
              f"{phases['overload']['retry_after_missing']}")
        rss = payload["rss_mib"]
        print(f"server RSS MiB: before {rss['before']:.0f}, max {rss['max']:.0f}, after {rss['after']:.0f}")
    if "mixed" in wanted:
        m = payload["mixed_load"]
        b = m["big_request"]
        print(f"\nmixed load: {m['small_alone']['clients']} small clients + 1 client of {b['num_sources']} sources "
              f"x {b['num_candidates']} candidates x {b['max_new_tokens']} new tokens (work {b['cost']}, "
              f"serve.max_request_cost {m['limits']['max_request_cost']})")
        for name in ("small_alone", "mixed"):
            print(phase_line(name, m[name], 12, str(m[name]["statuses"])))
        print(f"  small p99 mixed / alone: {m['p99_ratio']:.2f}x (target <= {MIXED_TARGET:.0f}x); max-cost client: "
              f"{m['mixed']['big']['statuses']}")
    if "maxcost" in wanted:
        m = payload["maxcost_load"]
        b = m["max_cost_request"]
        print(f"\nmaximum-cost client: {b['num_sources']} sources of {b['source_tokens']} tokens x "
              f"{b['num_candidates']} samples x {b['max_new_tokens']} new tokens, temperature {b['temperature']:g} "
              f"(work {b['cost']})")
        alone = m["max_alone"]
        print(f"  alone: {alone['status']} in {alone['seconds']:.2f} s (serve.request_timeout_s "
              f"{m['limits']['request_timeout_s']:g})")
        for name in ("small_alone", "max_mixed", "small_alone_long_timeout", "max_served"):
            p = m[name]
            print(phase_line(name, p, 25, f"load {p['loadavg_start'][0]:.2f}-{p['loadavg_end'][0]:.2f}  "
                                          f"{p.get('big', {}).get('statuses', '')}"))
        print(f"  small p99 beside the client, refused: {m['p99_ratio_refused']:.2f}x; admitted: "
              f"{m['p99_ratio_served']:.2f}x (target <= {MIXED_TARGET:.0f}x)")
    if not args.no_save:
        name = "serve_load_natural_eos" if args.natural_eos else "serve_load"
        if wanted == {"mixed"}:
            name += "_mixed"
        elif wanted == {"maxcost"}:
            name += "_maxcost"
        payload["command"] = "python bench/serve_load.py " + " ".join(sys.argv[1:])
        print("saved", save(name, payload))


if __name__ == "__main__":
    main()
