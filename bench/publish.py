"""Publishing a policy version: latency and the driver's peak memory, before and after the driver left the path.

    python bench/publish.py [--models base,large] [--repeats 5] [--threads 0]

Before ("driver"): the driver fetched learner rank 0's weights (``Learner.weights``, a CPU copy) and stored them
again with ``ray.put``. After ("rank0"): rank 0 returns them from ``Learner.publish_weights`` as the second of
two results (``num_returns=2``); Ray stores them in the object store as the call returns, and the driver
fetches only the first, small result (what ``LearnerGroup.publish`` does). The learner here is a Ray actor
holding a BART of the BART-base (140 M parameters) or BART-large (400 M) shape with random weights (built from
a BartConfig, no download), whose publishing methods are ``Learner``'s own; everything runs on CPU.

Each (model, path) runs in a fresh driver process, so that its peak resident set (``ru_maxrss``) is its own:
reported with the resident set after ``ray.init`` and the actor's start, and the growth between them. A
publish is timed from the driver's call until the driver may hand the reference on (the weights are stored);
the baseline is a bare ``ray.put`` of the same state dict, timed inside the actor where the weights are.
Medians over ``--repeats`` after one warm-up. Targets (issue #39): with the new path the driver's peak does
not grow with the model, and a publish costs at most 1.2x the bare ``ray.put``.
Saves bench/results/publish.json with the machine description.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import save  # noqa: E402

SHAPES = {  # the public checkpoints' shapes (facebook/bart-base, facebook/bart-large)
    "base": dict(d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
                 decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072),
    "large": dict(d_model=1024, encoder_layers=12, decoder_layers=12, encoder_attention_heads=16,
                  decoder_attention_heads=16, encoder_ffn_dim=4096, decoder_ffn_dim=4096),
}
VOCAB, POSITIONS = 50265, 1024
TARGET_RATIO = 1.2
OBJECT_STORE_BYTES = 5 * 2**30  # the before path holds two copies of BART-large (1.6 GB each) at once


class BenchRank:
    """The learner rank's side: a policy and ``Learner``'s own publishing methods (they read ``policy.model``
    and ``steps`` only)."""

    def __init__(self, shape: str, threads: int) -> None:
        from transformers import BartConfig, BartForConditionalGeneration

        from rlt2t.learner.learner import Learner

        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(0)
        config = BartConfig(vocab_size=VOCAB, max_position_embeddings=POSITIONS, **SHAPES[shape])
        self.policy = SimpleNamespace(model=BartForConditionalGeneration(config).eval())
        self.steps = 0
        self._learner = Learner

    def parameters(self) -> int:
        return sum(p.numel() for p in self.policy.model.parameters())

    def weights(self) -> dict[str, torch.Tensor]:  # before: what LearnerGroup.weights fetched
        return self._learner.weights(self)  # type: ignore[arg-type]

    def publish_weights(self) -> tuple[dict[str, int], dict[str, torch.Tensor]]:  # after
        return self._learner.publish_weights(self)  # type: ignore[arg-type]

    def bare_put_s(self) -> tuple[float, int]:
        """Seconds of one ``ray.put`` of the state dict the publish ships, here where it is; and its bytes."""
        import ray

        from rlt2t.learner.learner import published_weights

        weights = published_weights(self.policy.model)
        t0 = time.perf_counter()
        ref = ray.put(weights)
        seconds = time.perf_counter() - t0
        del ref
        return seconds, sum(t.numel() * t.element_size() for t in weights.values())


def rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20


def one(shape: str, path: str, repeats: int, threads: int) -> dict[str, Any]:
    """One driver process: ``repeats`` publishes of ``shape`` by ``path`` (``driver`` or ``rank0``)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=OBJECT_STORE_BYTES, log_to_driver=False,
             configure_logging=False, logging_level=logging.ERROR)
    rank: Any = ray.remote(BenchRank).options(num_cpus=1).remote(shape, threads)
    parameters = ray.get(rank.parameters.remote())
    start_rss = rss_mib()

    def publish() -> Any:
        if path == "driver":
            return ray.put(ray.get(rank.weights.remote()))  # the old _Publisher.publish
        summary, weights = rank.publish_weights.options(num_returns=2).remote()
        ray.get(summary)  # LearnerGroup.publish: the weights are stored once the summary is back
        return weights

    publish_s, bare_s = [], []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        ref = publish()
        seconds = time.perf_counter() - t0
        del ref  # freed before the next: the job keeps a few versions, not one per repeat
        put_s, nbytes = ray.get(rank.bare_put_s.remote())
        if i:  # the first is a warm-up
            publish_s.append(seconds)
            bare_s.append(put_s)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # Linux: KiB
    ray.shutdown()
    return {"model": f"bart-{shape}", "path": path, "parameters_m": round(parameters / 1e6, 1),
            "state_dict_mib": round(nbytes / 2**20, 1), "publish_s": [round(x, 4) for x in publish_s],
            "bare_put_s": [round(x, 4) for x in bare_s], "publish_s_median": round(statistics.median(publish_s), 4),
            "bare_put_s_median": round(statistics.median(bare_s), 4),
            "ratio_to_bare_put": round(statistics.median(publish_s) / statistics.median(bare_s), 3),
            "driver_rss_start_mib": round(start_rss, 1), "driver_peak_rss_mib": round(peak_rss, 1),
            "driver_rss_growth_mib": round(peak_rss - start_rss, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="base,large")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads of the learner actor (0: torch's)")
    ap.add_argument("--one", nargs=2, metavar=("MODEL", "PATH"), help=argparse.SUPPRESS)  # a child's run
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], args.one[1], args.repeats, args.threads)))
        return
    runs = []
    for shape in args.models.split(","):
        for path in ("driver", "rank0"):
            out = subprocess.run([sys.executable, __file__, "--one", shape, path, "--repeats", str(args.repeats),
                                  "--threads", str(args.threads)], check=True, capture_output=True, text=True,
                                 env={**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")})
            run = json.loads(out.stdout.strip().splitlines()[-1])
            runs.append(run)
            print(f"{run['model']:>10} {path:>6}: publish {run['publish_s_median']:.3f} s "
                  f"({run['ratio_to_bare_put']:.2f}x a bare ray.put of {run['bare_put_s_median']:.3f} s), "
                  f"driver RSS {run['driver_rss_start_mib']:.0f} -> peak {run['driver_peak_rss_mib']:.0f} MiB "
                  f"(+{run['driver_rss_growth_mib']:.0f})", flush=True)
    after = [r for r in runs if r["path"] == "rank0"]
    growth = [r["driver_rss_growth_mib"] for r in after]
    # "Does not grow with the model": the new path's growth is far below the smallest state dict, and does not
    # rise from one model to the next by more than a few MiB (noise), whatever their sizes.
    smallest = min(r["state_dict_mib"] for r in after)
    rss_flat = max(growth) < 0.1 * smallest and max(growth) - min(growth) < 0.02 * smallest
    ratio_ok = all(r["ratio_to_bare_put"] <= TARGET_RATIO for r in after)
    payload = {"benchmark": "publish", "command": f"python bench/publish.py --models {args.models} --repeats "
               f"{args.repeats}" + (f" --threads {args.threads}" if args.threads else ""),
               "repeats": args.repeats, "device": "cpu", "target_ratio_to_bare_put": TARGET_RATIO,
               "runs": runs, "rank0_driver_rss_growth_mib": growth, "driver_rss_flat": rss_flat,
               "ratio_within_target": ratio_ok, "meets_target": rss_flat and ratio_ok}
    print(f"driver RSS flat across models: {rss_flat}; publish within {TARGET_RATIO}x a bare ray.put: {ratio_ok}")
    print("saved", save("publish", payload))


if __name__ == "__main__":
    main()
