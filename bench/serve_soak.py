"""Policy server memory over a soak of maximum-cost requests: does the memory of a heavy request come back?

    python bench/serve_soak.py [--requests 20] [--cancelled 20] [--arms release,no-release] [--baseline-requests 4]

Starts the policy server in a subprocess on 127.0.0.1 (the app of `rlt2t serve policy`, built by this script so
that an arm can change one thing) serving a `small`-preset policy (weights from scratch, seed 0, EOS suppressed:
every row decodes to its limit), with serve.request_timeout_s raised so that the maximum-cost request is admitted.
Then, one after another:

  complete      --requests maximum-cost requests (bench/serve_load.py's: 8 sources of 255 tokens x 32 samples x
                255 new tokens at temperature 100), each answered before the next is sent;
  disconnected  --cancelled / 2 more, each dropped by its client: the connection closed after 1 to 10 s (varied);
  deadline      the other half, each dropped at its deadline, on a second server of the same arm.

The deadline is serve.request_timeout_s from arrival, one value per server, and admission refuses at once what
is predicted to miss it: the deadline requests go to a server with serve.request_timeout_s = --deadline-s whose
predictions are forced to zero (what a machine that slowed down after admitting them would see). Its RSS is
reported on its own.

The server's resident memory (psutil) is read before the first request and after each one, answered or
cancelled, once the server is idle again (no model call running, nothing queued). Arms: `release` is the
server as shipped (the C heap trimmed after heavy work, ``rlt2t.services.memory``); `no-release` the same with
that call made a no-op: the cause, measured (on --baseline-requests requests and as many cancelled ones).
Reported: RSS before, after the first request, max and last, the last / after-first ratio (target <= 1.15) and
what the first request left held above the level before it. Saves bench/results/serve_load_soak.json with the
machine description and the load averages.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_server import CliServer  # noqa: E402
from machine_info import save  # noqa: E402
from serve_load import load_average, max_cost_request, prepare  # noqa: E402

from rlt2t.common.config import ServeConfig  # noqa: E402

TARGET = 1.15
SMALL = {"sources": ["1 2 3 4 5 6 7 8"], "num_candidates": 1, "top_k": 3, "temperature": 0.8, "max_new_tokens": 16}


def child(model_dir: str, workdir: str, release: bool, timeout_s: float, no_prediction: bool) -> None:
    """Serve the policy app the way `rlt2t serve policy` does, with the arm's one change."""
    from rlt2t.cmd_serve import run_server
    from rlt2t.common.config import load_config
    from rlt2t.services import policy_app

    if not release:
        policy_app.release_memory = lambda: False  # type: ignore[assignment]
    cfg = load_config([], [f"run.dir={workdir}", "model.preset=small", "serve.device=cpu",
                           f"serve.request_timeout_s={timeout_s}"])
    app = policy_app.create_app(cfg, checkpoint_dir=model_dir)
    if no_prediction:
        app.state.batcher.timing.seconds = lambda work, calls=1: 0.0
    run_server(app, "127.0.0.1", 0, "policy", cfg.serve)


class SoakServer(CliServer):
    """This script's child server on a free loopback port, with its resident memory."""

    def __init__(self, model_dir: Path, workdir: Path, *, release: bool, timeout_s: float,
                 no_prediction: bool = False) -> None:
        args = [__file__, "--child", str(model_dir), str(workdir), "--timeout", str(timeout_s)]
        args += [] if release else ["--no-release"]
        args += ["--no-prediction"] if no_prediction else []
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        env.pop("RLT2T_API_TOKEN", None)
        super().__init__(args, "serving policy on ", env, module=None)
        self.ps = psutil.Process(self.proc.pid)
        with httpx.Client(base_url=self.url, timeout=600) as http:  # start-up (calibration) and first allocations
            for _ in range(5):
                http.post("/v1/candidates", json=SMALL).raise_for_status()
            # what the server predicts with: its calibrated seconds per feature and its scale
            lines = http.get("/metrics").text.splitlines()
            self.service_time = {line.split()[0]: float(line.split()[1]) for line in lines
                                 if line.startswith("rlt2t_policy_service_time")}

    def rss_mib(self) -> float:
        return self.ps.memory_info().rss / 2**20

    def idle(self, timeout_s: float = 600.0) -> None:
        """Until the server has no model call running and nothing queued, then 1 s more (its release after a
        call runs on the worker once the call is done)."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(base_url=self.url, timeout=60) as http:
            while time.monotonic() < deadline:
                text = http.get("/metrics").text
                if "rlt2t_policy_queue_cost 0.0" in text and "rlt2t_policy_running_cost 0.0" in text:
                    break
                time.sleep(0.5)
        time.sleep(1.0)


def soak(model_dir: Path, work: Path, args, release: bool) -> dict[str, Any]:
    requests = args.requests if release else min(args.requests, args.baseline_requests)
    cancelled = args.cancelled if release else min(args.cancelled, args.baseline_requests)
    big = max_cost_request(ServeConfig(), positions=256)
    rng = random.Random(0)
    out: dict[str, Any] = {"loadavg_start": load_average()}
    server = SoakServer(model_dir, work, release=release, timeout_s=args.long_timeout)
    try:
        out["rss_before_mib"] = server.rss_mib()
        out["service_time"] = server.service_time
        complete = []
        with httpx.Client(base_url=server.url, timeout=args.long_timeout + 60) as http:
            for i in range(requests):
                start = time.perf_counter()
                r = http.post("/v1/candidates", json=big)
                seconds = time.perf_counter() - start
                server.idle()  # the answer is sent before the worker's release after the call: read RSS after it
                complete.append({"status": r.status_code, "seconds": seconds,
                                 "rss_mib": server.rss_mib(), "refusal": r.json() if r.status_code != 200 else None})
                print(f"  complete {i + 1}/{requests}: {r.status_code} in {complete[-1]['seconds']:.1f} s, "
                      f"RSS {complete[-1]['rss_mib']:.0f} MiB", flush=True)
        disconnected = []
        for i in range(cancelled // 2):
            after = 1.0 + 9.0 * rng.random()
            try:
                with httpx.Client(base_url=server.url, timeout=after) as http:
                    status = str(http.post("/v1/candidates", json=big).status_code)  # answered before: not cancelled
            except httpx.TimeoutException:
                status = "disconnected"
            server.idle()
            disconnected.append({"after_s": after, "status": status, "rss_mib": server.rss_mib()})
            print(f"  {status} {i + 1}: after {after:.1f} s, RSS {disconnected[-1]['rss_mib']:.0f} MiB", flush=True)
        out.update(complete=complete, disconnected=disconnected, rss_end_mib=server.rss_mib())
    finally:
        server.stop()
    late = SoakServer(model_dir, work, release=release, timeout_s=args.deadline_s, no_prediction=True)
    try:
        deadlines = [{"rss_before_mib": late.rss_mib()}]
        with httpx.Client(base_url=late.url, timeout=600) as http:
            for i in range(cancelled - cancelled // 2):
                r = http.post("/v1/candidates", json=big)
                late.idle()
                deadlines.append({"status": r.status_code, "rss_mib": late.rss_mib()})
                print(f"  deadline {i + 1}: {r.status_code}, RSS {deadlines[-1]['rss_mib']:.0f} MiB", flush=True)
        out["deadline"] = deadlines
    finally:
        late.stop()
    rss = [c["rss_mib"] for c in out["complete"]] + [d["rss_mib"] for d in out["disconnected"]]
    first = rss[0]
    out.update(rss_after_first_mib=first, rss_max_mib=max(rss), rss_last_mib=rss[-1], last_over_first=rss[-1] / first,
               max_over_first=max(rss) / first, held_by_first_mib=first - out["rss_before_mib"],
               loadavg_end=load_average())
    late_rss = [d["rss_mib"] for d in out["deadline"][1:]]
    if late_rss:
        out.update(deadline_last_over_first=late_rss[-1] / late_rss[0],
                   deadline_max_over_first=max(late_rss) / late_rss[0])
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        ap = argparse.ArgumentParser()
        ap.add_argument("--child", nargs=2)
        ap.add_argument("--timeout", type=float)
        ap.add_argument("--no-release", action="store_true")
        ap.add_argument("--no-prediction", action="store_true")
        a = ap.parse_args()
        child(a.child[0], a.child[1], not a.no_release, a.timeout, a.no_prediction)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20, help="maximum-cost requests answered, one after another")
    ap.add_argument("--cancelled", type=int, default=20, help="maximum-cost requests cancelled (half by the client "
                    "disconnecting, half by their deadline)")
    ap.add_argument("--arms", default="release", help="comma-separated: release (as shipped), no-release")
    ap.add_argument("--baseline-requests", type=int, default=4,
                    help="the no-release arm's answered and cancelled requests (each at most the release arm's)")
    ap.add_argument("--long-timeout", type=float, default=1800.0, help="serve.request_timeout_s of the soak server")
    ap.add_argument("--deadline-s", type=float, default=5.0,
                    help="serve.request_timeout_s of the server whose requests end at their deadline")
    ap.add_argument("--no-save", action="store_true", help="print only; leave bench/results/ alone")
    args = ap.parse_args()
    arms = args.arms.split(",")
    if not set(arms) <= {"release", "no-release"}:
        ap.error(f"--arms: choose from release, no-release (got {args.arms!r})")
    payload: dict[str, Any] = {"command": "python bench/serve_soak.py " + " ".join(sys.argv[1:]),
                               "request": {k: v for k, v in max_cost_request(ServeConfig(), 256).items()
                                           if k != "sources"}, "target_last_over_first": TARGET, "arms": {}}
    with tempfile.TemporaryDirectory(prefix="rlt2t-serve-soak-") as tmp:
        work = Path(tmp)
        model_dir = prepare(work)
        for arm in arms:
            print(f"{arm}:", flush=True)
            payload["arms"][arm] = soak(model_dir, work, args, release=arm == "release")
    print(f"\n{'arm':<12} {'before':>7} {'first':>7} {'max':>7} {'last':>7} {'last/first':>10}  (RSS MiB)")
    for arm, r in payload["arms"].items():
        print(f"{arm:<12} {r['rss_before_mib']:>7.0f} {r['rss_after_first_mib']:>7.0f} {r['rss_max_mib']:>7.0f} "
              f"{r['rss_last_mib']:>7.0f} {r['last_over_first']:>10.2f}  target <= {TARGET}; load "
              f"{r['loadavg_start'][0]:.2f}-{r['loadavg_end'][0]:.2f}")
    if not args.no_save:
        print("saved", save("serve_load_soak", payload))


if __name__ == "__main__":
    main()
