"""Peak memory and time to read a 1,000,000-row Parquet file, before and after rlt2t read Parquet itself.

    python bench/data_load.py [--rows 1000000]

The file (id, source of 8-64 integer tokens, target of 2-16, as the synthetic task's texts) is written to a
temporary directory. Each reading runs in a fresh Python process that has imported rlt2t's data module; its
peak resident memory (VmHWM) is reported whole and above what the process held before reading.

- before: the file converted to JSONL, as a user had to, and read with ``load_examples`` (a list of examples);
- after: ``load_examples`` on the Parquet file (validated in batches, served from its Arrow table);
- after, every example built: the same load, then one pass over all its examples (what SFT's tokenisation does);
- after, streamed: ``iter_examples`` over the file (what ``rlt2t data validate`` does).

Prints a table and saves bench/results/data_load.json with the machine description.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

MODES = {
    "before": "JSONL (converted from the Parquet file), load_examples: a list",
    "after": "Parquet, load_examples: ArrowExamples",
    "after_iterated": "Parquet, load_examples, then every example built once",
    "after_streamed": "Parquet, iter_examples (as `rlt2t data validate`)",
}
CHUNK = 100_000  # rows generated, and written as one Parquet row group, at a time


def write_parquet(path: Path, rows: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    with pq.ParquetWriter(path, pa.schema([("id", pa.string()), ("source", pa.string()), ("target", pa.string())])
                          ) as writer:
        for start in range(0, rows, CHUNK):
            n = min(CHUNK, rows - start)
            texts = {}
            for field, (low, high) in (("source", (8, 65)), ("target", (2, 17))):
                tokens = rng.integers(0, 1894, size=(n, high - 1)).astype(str)
                lengths = rng.integers(low, high, size=n)
                texts[field] = [" ".join(row[:k]) for row, k in zip(tokens, lengths, strict=True)]
            writer.write_table(pa.table({"id": [f"r{i}" for i in range(start, start + n)], **texts}))


def to_jsonl(parquet: Path, out: Path) -> None:
    """What a user had to do before: every row to a JSON line."""
    with out.open("w") as f:
        for batch in pq.ParquetFile(parquet).iter_batches(batch_size=CHUNK):
            f.writelines(json.dumps(row) + "\n" for row in batch.to_pylist())


def memory_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(mode: str, path: str) -> None:
    """One reading in this (fresh) process; prints its figures as JSON."""
    from rlt2t.common.data import iter_examples, load_examples

    before = memory_mib("VmRSS")
    t0 = time.perf_counter()
    if mode == "after_streamed":
        count = sum(1 for _ in iter_examples(path))
    else:
        examples = load_examples(path)
        count = len(examples)
        if mode == "after_iterated":
            count = sum(1 for e in examples if e.source)
    seconds = time.perf_counter() - t0
    peak = memory_mib("VmHWM")
    print(json.dumps({"mode": mode, "examples": count, "seconds": round(seconds, 2),
                      "peak_rss_mib": round(peak, 1), "rss_before_mib": round(before, 1),
                      "peak_above_before_mib": round(peak - before, 1)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--child", nargs=2, metavar=("MODE", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    # Here, not at the top: machine_info imports torch, which the measured (child) processes must not hold.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine_info import save

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        parquet, jsonl = Path(tmp) / "data.parquet", Path(tmp) / "data.jsonl"
        t0 = time.perf_counter()
        write_parquet(parquet, args.rows)
        print(f"wrote {args.rows} rows to Parquet in {time.perf_counter() - t0:.1f} s", flush=True)
        t0 = time.perf_counter()
        to_jsonl(parquet, jsonl)
        convert_s = time.perf_counter() - t0
        sizes = {f"{p.suffix[1:]}_mib": round(p.stat().st_size / 2**20, 1) for p in (parquet, jsonl)}
        for mode, what in MODES.items():
            path = jsonl if mode == "before" else parquet
            out = subprocess.run([sys.executable, __file__, "--child", mode, str(path)], capture_output=True,
                                 text=True, check=True)
            r = {**json.loads(out.stdout.strip().splitlines()[-1]), "what": what}
            rows.append(r)
            print(f"{mode:>15}  {r['seconds']:7.2f} s  peak RSS {r['peak_rss_mib']:8.1f} MiB "
                  f"({r['peak_above_before_mib']:8.1f} above the {r['rss_before_mib']:.0f} MiB after imports)  "
                  f"{r['examples']} examples", flush=True)
    print(f"(before also needed the conversion to JSONL: {convert_s:.1f} s; files: {sizes})")
    print("saved", save("data_load", {"benchmark": "data_load", "rows": args.rows, **sizes,
                                      "jsonl_conversion_s": round(convert_s, 1), "results": rows}))


if __name__ == "__main__":
    main()
