"""The efficacy benchmark's baseline rule (bench/algorithms.py `summarize`), which decides its headline claim.

Every RL arm is compared, seed by seed, with what likelihood training reaches as a user would keep it: of the SFT
checkpoint itself and the continued-SFT arms, the one with the best mean validation score.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def summarize():
    path = REPO / "bench" / "algorithms.py"
    spec = importlib.util.spec_from_file_location("bench_algorithms_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)
    return module.summarize


def _run(valid: float, test: float, heldout: float | None = None) -> dict:
    r = {"valid": [{"task_score": valid - 0.5}, {"task_score": valid}], "test": {"task_score": test},
         "kl_to_start": 1.0, "seconds": 10.0}
    if heldout is not None:
        r["heldout_task_score"] = heldout
    return r


def _sft(valid: float, test: float, heldout: float | None = None) -> dict:
    r = {"valid_task_score": valid, "test_task_score": test, "seconds": 5.0}
    if heldout is not None:
        r["heldout_task_score"] = heldout
    return r


def test_the_start_is_the_baseline_when_continued_sft_lost_validation_score(summarize):
    sft = {1: _sft(1.8, 1.6, 0.9), 2: _sft(1.9, 1.7, 1.0), 3: _sft(2.0, 1.8, 1.1)}
    arms = {"continued_sft": {s: _run(1.5, 1.0, 0.5) for s in sft},
            "grpo": {1: _run(2.1, 1.8, 1.0), 2: _run(2.1, 1.92, 1.1), 3: _run(2.1, 2.04, 1.2)}}
    out = summarize(sft, arms)
    assert out["baseline"] == "sft"
    d = out["grpo"]["paired_diff_test"]
    assert d["per_seed"] == pytest.approx([0.2, 0.22, 0.24])  # against the start, not continued SFT (+0.8 to 1.04)
    assert d["mean"] == pytest.approx(0.22) and d["std"] == pytest.approx(0.02)
    assert d["sigmas"] == pytest.approx(11.0) and d["relative"] == pytest.approx(0.22 / 1.7)
    assert out["grpo"]["paired_diff_heldout"]["per_seed"] == pytest.approx([0.1, 0.1, 0.1])
    assert out["grpo"]["beats_sft_on_test"] is True
    # continued SFT is compared with the start too, and is never flagged as beating it
    assert out["continued_sft"]["paired_diff_test"]["per_seed"] == pytest.approx([-0.6, -0.7, -0.8])
    assert "beats_sft_on_test" not in out["continued_sft"]


def test_the_continued_sft_variant_with_the_best_validation_is_the_baseline(summarize):
    sft = {1: _sft(1.0, 1.0), 2: _sft(1.0, 1.0), 3: _sft(1.0, 1.0)}
    arms = {"continued_sft": {s: _run(1.05, 1.1) for s in sft},
            "continued_sft:lr5e-5": {s: _run(1.2, 1.3) for s in sft},
            "rloo": {1: _run(1.3, 1.35), 2: _run(1.3, 1.4), 3: _run(1.3, 1.45)}}
    out = summarize(sft, arms)
    assert out["baseline"] == "continued_sft:lr5e-5"
    d = out["rloo"]["paired_diff_test"]
    assert d["per_seed"] == pytest.approx([0.05, 0.1, 0.15])
    assert d["sigmas"] == pytest.approx(2.0)  # not more than 2 σ, and +7.7 %: no win
    assert out["rloo"]["beats_sft_on_test"] is False
    assert "paired_diff_heldout" not in out["rloo"]  # no held-out rows were scored
    assert "beats_sft_on_test" not in out["continued_sft"]


def test_the_target_must_hold_against_every_likelihood_checkpoint_not_only_the_chosen_one(summarize):
    sft = {1: _sft(2.0, 1.0), 2: _sft(2.0, 1.0), 3: _sft(2.0, 1.0)}
    arms = {"continued_sft": {1: _run(1.5, 1.15), 2: _run(1.5, 1.3), 3: _run(1.5, 1.1)},
            "grpo": {1: _run(2.1, 1.2), 2: _run(2.1, 1.22), 3: _run(2.1, 1.24)}}
    out = summarize(sft, arms)
    assert out["baseline"] == "sft"
    assert out["grpo"]["paired_diff_test"]["sigmas"] == pytest.approx(11.0)  # clears it against the start ...
    each = out["grpo"]["paired_diff_test_each"]
    assert each["sft"]["sigmas"] == pytest.approx(11.0)
    assert each["continued_sft"]["mean"] == pytest.approx(0.11 / 3)  # ... not against continued SFT's test scores
    assert out["grpo"]["beats_sft_on_test"] is False


def test_without_a_continued_sft_arm_the_start_is_the_baseline_and_there_is_no_verdict(summarize):
    sft = {1: _sft(1.0, 1.0), 2: _sft(1.0, 1.0)}
    out = summarize(sft, {"grpo": {1: _run(1.3, 1.4), 2: _run(1.3, 1.5)}})
    assert out["baseline"] == "sft" and out["baseline_candidates"] == ["sft"]
    assert out["grpo"]["paired_diff_test"]["per_seed"] == pytest.approx([0.4, 0.5])
    assert "beats_sft_on_test" not in out["grpo"]  # the target asks for continued SFT as well
