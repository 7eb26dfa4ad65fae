"""bench/paired_bootstrap.py (the test split's own noise on a seed's paired difference) and bench/group_spread.py."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from rlt2t.common.metrics import get_metric

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def boot(bench_script):
    return bench_script("paired_bootstrap")


class ExactMatch:
    """A corpus metric that is a mean over rows, so the bootstrap std has a closed form."""

    name = "exact_match"

    def corpus(self, hyps, refs):
        return sum(h in r for h, r in zip(hyps, refs, strict=True)) / len(hyps)


def test_the_noise_of_a_mean_metric_is_the_standard_error_of_the_row_differences(boot):
    rng = random.Random(3)
    n = 400
    refs = [[f"t{i}"] for i in range(n)]
    arm = [f"t{i}" if rng.random() < 0.6 else "x" for i in range(n)]
    base = [f"t{i}" if rng.random() < 0.5 else "x" for i in range(n)]
    diff, noise = boot.paired_bootstrap(arm, base, refs, ExactMatch(), samples=1500)
    rows = [(a in r) - (b in r) for a, b, r in zip(arm, base, refs, strict=True)]
    mean = sum(rows) / n
    assert diff == pytest.approx(mean)
    se = math.sqrt(sum((d - mean) ** 2 for d in rows) / n / n)
    assert noise == pytest.approx(se, rel=0.1)


def test_same_predictions_have_no_difference_and_no_noise(boot):
    refs = [["a b c"], ["d e f"], ["g h"]]
    preds = ["a b", "d e f", "g"]
    assert boot.paired_bootstrap(preds, preds, refs, get_metric("task_score"), samples=20) == (0.0, 0.0)
    with pytest.raises(ValueError, match="same rows"):
        boot.paired_bootstrap(preds, preds[:2], refs, get_metric("task_score"), samples=20)


def _write_run(root: Path, name: str, preds: dict[str, str], refs: dict[str, list[str]], label: str = "last") -> str:
    run = root / name
    (run / "config").mkdir(parents=True)
    (run / "config" / "rl.yaml").write_text("metric:\n  bleu_weight: 0.0\n")
    (run / "eval").mkdir()
    (run / "eval" / f"{label}-test.predictions.jsonl").write_text("".join(
        json.dumps({"id": i, "prediction": p, "target": refs[i][0], "references": refs[i]}) + "\n"
        for i, p in preds.items()))
    return str(run / "rl" / "checkpoints" / "epoch-0002")


def test_measure_reads_each_seeds_predictions_and_refuses_a_changed_run(boot, tmp_path):
    metric = get_metric("task_score", bleu_weight=0.0)
    refs = {f"s{i}": [f"word{i} common words here", f"word{i} other words"] for i in range(30)}
    rng = random.Random(0)
    ids = sorted(refs)
    payload = {"sft": {}, "arms": {"grpo": {}, "continued_sft": {}}}
    for seed in ("1", "2"):
        seed_dir = tmp_path / f"seed{seed}"
        sft = {i: rng.choice(["common words", refs[i][0], "nothing"]) for i in ids}
        grpo = {i: rng.choice([refs[i][0], refs[i][1], "common words"]) for i in ids}
        cont = {i: rng.choice(["common words", "nothing"]) for i in ids}
        _write_run(seed_dir, "continued_sft", sft, refs, label="sft")  # the probe's dir holds the SFT readings
        # (continued SFT's own run is another dir; the benchmark names it after its sources)
        cont_ckpt = _write_run(seed_dir, "continued_sft-train_rl", cont, refs)
        grpo_ckpt = _write_run(seed_dir, "grpo-train_rl", grpo, refs)

        def score(p):
            return metric.corpus([p[i] for i in ids], [refs[i] for i in ids])

        payload["sft"][seed] = {"test_task_score": score(sft)}
        payload["arms"]["grpo"][seed] = {"checkpoint": grpo_ckpt, "test": {"task_score": score(grpo)}}
        payload["arms"]["continued_sft"][seed] = {"checkpoint": cont_ckpt, "test": {"task_score": score(cont)}}
    out = boot.measure(payload, samples=30)
    assert set(out) == {"grpo - sft", "grpo - continued_sft", "continued_sft - sft"}
    for name, r in out.items():
        arm, base = name.split(" - ")
        for seed, v in r["per_seed"].items():
            base_score = payload["sft"][seed]["test_task_score"] if base == "sft" else \
                payload["arms"][base][seed]["test"]["task_score"]
            assert v["diff"] == pytest.approx(payload["arms"][arm][seed]["test"]["task_score"] - base_score)
            assert v["noise_std"] > 0
        assert r["effect_std"] <= r["seed_std"]
    assert set(boot.measure(payload, samples=5, only=["grpo"])) == {"grpo - sft", "grpo - continued_sft"}
    with pytest.raises(ValueError, match="ppo not in the result"):
        boot.measure(payload, samples=5, only=["ppo"])
    payload["arms"]["grpo"]["2"]["test"]["task_score"] += 0.01
    with pytest.raises(ValueError, match="grpo seed 2: the saved predictions score"):
        boot.measure(payload, samples=5)


def test_group_spread_counts_tied_thin_and_wide_sources(bench_script):
    out = bench_script("group_spread").spread([0.0, 0.01, 0.1, 0.9], [0.0, 0.1, 0.5, 1.4], [1, 2, 6, 6])
    assert out == {"sources": 4, "tied": 0.25, "std_under_0.05": 0.25, "std_under_0.2": 0.5, "median_std": 0.055,
                   "mean_reward": 0.5, "distinct_samples": 3.75}
