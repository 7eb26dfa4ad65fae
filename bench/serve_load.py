"""Policy server under load, on loopback: does request batching pay, and does overload stay graceful?

    python bench/serve_load.py [--seconds 15] [--clients 32] [--checkpoint DIR]

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
  overload  2 x --clients clients against the batched server, whose serve.max_queue is --clients
            sources: only 200 and 503 (+ Retry-After) may come back; a client that gets a 503 waits
            50 ms and tries again. The server's RSS is sampled (psutil) throughout.

Reported: requests/s and p50/p99 latency of each phase, the batched/batch-1 throughput ratio (target
>= 4x), the model-only ceiling of that ratio (the server's backend called in this process with no HTTP:
sources/s at 1 source per call vs --clients sources per call, same decoding settings), the overload status counts (target: nothing but 200 and 503) and the server RSS before, max and
after (target: bounded). The servers are stopped with SIGTERM (killed if they do not exit in 30 s) and
everything ends by itself. Saves bench/results/serve_load.json with the machine description.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
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
from machine_info import save  # noqa: E402

from rlt2t.common.config import ModelConfig  # noqa: E402
from rlt2t.common.io import atomic_directory  # noqa: E402
from rlt2t.common.policy import load_policy  # noqa: E402
from rlt2t.common.tokenization import build_ids_tokenizer, save_tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SPEEDUP_TARGET = 4.0
REQUEST = {"num_candidates": 1, "top_k": 3, "temperature": 0.8, "max_new_tokens": 16}


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


class Server:
    """`rlt2t serve policy` in a subprocess; ``url`` once it printed its listening line."""

    def __init__(self, model_dir: Path, workdir: Path, overrides: list[str]) -> None:
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        env.pop("RLT2T_API_TOKEN", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rlt2t.cli", "serve", "policy", "--checkpoint-dir", str(model_dir), "--port", "0",
             f"run.dir={workdir}", "model.preset=small", *overrides],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=REPO)
        line = self.proc.stdout.readline()
        if not line.startswith("serving policy on "):
            self.stop()
            raise RuntimeError(f"server did not start (exit {self.proc.poll()}): {line!r}")
        self.url = line.split()[-1]
        self.ps = psutil.Process(self.proc.pid)

    def rss_mib(self) -> float:
        return self.ps.memory_info().rss / 2**20

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


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
    return [" ".join(str(rng.randrange(1894)) for _ in range(24)) for _ in range(n)]


async def load(url: str, clients: int, seconds: float, texts: list[str]) -> dict[str, Any]:
    """``clients`` loops posting one request after another for ``seconds``; status counts and latencies."""
    statuses: Counter[str] = Counter()
    latencies: list[float] = []
    retry_after_missing = 0
    deadline = time.monotonic() + seconds

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
                statuses[str(r.status_code)] += 1
                if r.status_code == 200:
                    latencies.append(time.perf_counter() - start)
                    k += clients
                elif r.status_code == 503:
                    retry_after_missing += "Retry-After" not in r.headers
                    await asyncio.sleep(0.05)

    t0 = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    wall = time.perf_counter() - t0
    lat = np.array(latencies) if latencies else np.array([float("nan")])
    return {"clients": clients, "wall_s": wall, "ok": len(latencies), "requests_per_s": len(latencies) / wall,
            "p50_ms": float(np.percentile(lat, 50) * 1000), "p99_ms": float(np.percentile(lat, 99) * 1000),
            "statuses": dict(statuses), "retry_after_missing": retry_after_missing}


def sampled_rss(server: Server, stop: threading.Event, out: list[float]) -> None:
    while not stop.wait(0.25):
        try:
            out.append(server.rss_mib())
        except psutil.Error:
            return


def run_phase(server: Server, clients: int, seconds: float, texts: list[str], rss: list[float]) -> dict[str, Any]:
    stop = threading.Event()
    sampler = threading.Thread(target=sampled_rss, args=(server, stop, rss), daemon=True)
    sampler.start()
    try:
        return asyncio.run(load(server.url, clients, seconds, texts))
    finally:
        stop.set()
        sampler.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=15.0, help="duration of each load phase")
    ap.add_argument("--clients", type=int, default=32, help="concurrent clients (overload uses twice as many)")
    ap.add_argument("--checkpoint", default=None, help="model/checkpoint directory (default: small preset, seed 0)")
    ap.add_argument("--natural-eos", action="store_true",
                    help="let the from-scratch model stop at its own EOS (about 3 tokens) instead of 16 tokens")
    ap.add_argument("--no-save", action="store_true", help="print only; leave bench/results/ alone")
    args = ap.parse_args()
    texts = sources(512)
    with tempfile.TemporaryDirectory(prefix="rlt2t-serve-load-") as tmp:
        work = Path(tmp)
        model_dir = Path(args.checkpoint) if args.checkpoint else prepare(work, natural_eos=args.natural_eos)
        phases: dict[str, Any] = {}
        rss: dict[str, list[float]] = {}

        batched = Server(model_dir, work, ["serve.max_batch_size=32", "serve.max_wait_ms=5",
                                           f"serve.max_queue={args.clients}"])
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

        single = Server(model_dir, work, ["serve.max_batch_size=1", "serve.max_wait_ms=0", "serve.max_queue=1024"])
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
    only_200_503 = set(over) <= {"200", "503"}
    rss_max = max(rss["batched"] + rss["overload"], default=float("nan"))
    print(f"\n{'phase':<10} {'clients':>7} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8}  statuses")
    for name in ("batched", "batch1", "overload"):
        p = phases[name]
        print(f"{name:<10} {p['clients']:>7} {p['requests_per_s']:>8.1f} {p['p50_ms']:>8.0f} {p['p99_ms']:>8.0f}  "
              f"{p['statuses']}")
    print(f"\nbatching speedup: {speedup:.2f}x (target >= {SPEEDUP_TARGET:.0f}x; the model alone batches "
          f"{ceiling['ratio']:.2f}x on this machine)")
    print(f"overload: only 200/503: {only_200_503}; 503s without Retry-After: {phases['overload']['retry_after_missing']}")
    print(f"server RSS MiB: before {rss_before:.0f}, max {rss_max:.0f}, after {rss_after:.0f}")
    payload = {
        "request": REQUEST, "seconds": args.seconds, "warmup": warm["statuses"],
        "phases": phases, "speedup": speedup, "speedup_target": SPEEDUP_TARGET, "model_only": ceiling,
        "overload_only_200_503": only_200_503,
        "rss_mib": {"before": rss_before, "max": rss_max, "after": rss_after},
        "model": str(args.checkpoint or "preset:small, seed 0"),
        "eos": "natural" if args.natural_eos or args.checkpoint else "suppressed (16 tokens per request)",
    }
    if not args.no_save:
        print("saved", save("serve_load_natural_eos" if args.natural_eos else "serve_load", payload))


if __name__ == "__main__":
    main()
