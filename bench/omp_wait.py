"""SFT step speed by torch thread count and OpenMP wait policy, on an idle machine and beside other work.

    python bench/omp_wait.py [--preset small] [--batch 32] [--busy 1]

Why: torch's CPU kernels run on OpenMP threads that, by default, spin while they wait for each other. When
another process holds one of the cores, a thread that is descheduled keeps the others spinning at every op, and a
step can run many times slower than on one thread (`make demo` beside a training job on a 2-core machine ran its
pretraining at 4 examples/s instead of about 200). ``OMP_WAIT_POLICY=PASSIVE`` makes the waiting threads sleep.

Each cell is a fresh process (the thread count and the wait policy are read when torch loads), timing the SFT
step of bench/sft_step.py (forward, backward, clip, AdamW) on the preset; "busy" runs ``--busy`` pure-Python
loops at the same priority beside it, started before and stopped after the cell. Prints a table and saves
bench/results/omp_wait.json with the machine description.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
POLICIES = ("default", "PASSIVE")


def worker(preset: str, batch: int, threads: int) -> dict:
    """One cell, in this process: bench/sft_step.py's step on ``threads`` torch threads."""
    import torch

    torch.set_num_threads(threads)
    sys.path.insert(0, str(HERE))
    from sft_step import ID_VOCAB, bench

    from rlt2t.common.tokenization import build_ids_tokenizer, save_tokenizer
    from rlt2t.common.tracking import quiet_transformers

    quiet_transformers()
    with tempfile.TemporaryDirectory() as tmp:
        save_tokenizer(build_ids_tokenizer(ID_VOCAB), tmp)
        return bench(preset, Path(tmp), batch, warmup=3, steps=12)


def cell(preset: str, batch: int, threads: int, policy: str, busy: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["OMP_NUM_THREADS"] = str(threads)
    if policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        done = subprocess.run([sys.executable, __file__, "--worker", "--preset", preset, "--batch", str(batch),
                               "--threads", str(threads)], env=env, capture_output=True, text=True, check=True)
    finally:
        for p in loops:
            p.kill()
            p.wait()
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", help="the model preset (the demo's: small)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--busy", type=int, default=1, help="competing busy loops in the busy cells")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.preset, args.batch, args.threads)))
        return
    sys.path.insert(0, str(HERE))
    from machine_info import save

    threads = sorted({1, os.cpu_count() or 1})
    rows = []
    for busy in (0, args.busy):
        for n in threads:
            for policy in POLICIES:
                r = cell(args.preset, args.batch, n, policy, busy)
                rows.append({"busy_loops": busy, "threads": n, "omp_wait_policy": policy,
                             "examples_per_s": r["examples_per_s"], "step_s_median": r["step_s_median"]})
                print(f"busy {busy}  threads {n}  OMP_WAIT_POLICY {policy:>7}: {r['examples_per_s']:8.1f} examples/s "
                      f"(step {r['step_s_median'] * 1000:.0f} ms)", flush=True)
    print("saved", save("omp_wait", {"benchmark": "omp_wait", "preset": args.preset, "batch": args.batch,
                                     "command": f"python bench/omp_wait.py --preset {args.preset} --batch "
                                                f"{args.batch} --busy {args.busy}", "results": rows}))


if __name__ == "__main__":
    main()
