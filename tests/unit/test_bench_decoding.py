"""The decoding benchmark's pure helpers (bench/decoding.py): the paired differences and #41's target verdicts, the
rerank pick, the cut of flattened pool scores, the training command of the docstring tasks, and the summary."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench(bench_script):
    return bench_script("decoding")


def test_paired_differences_and_the_target_verdicts(bench):
    d = bench.paired([1.2, 1.3, 1.1], [1.0, 1.1, 1.0], target=0.08, needs_sigmas=True)
    assert d["per_seed"] == pytest.approx([0.2, 0.2, 0.1])
    assert d["mean"] == pytest.approx(0.5 / 3)
    assert d["std"] == pytest.approx(np.std([0.2, 0.2, 0.1], ddof=1))
    assert d["sigmas"] == pytest.approx(d["mean"] / d["std"])  # 2.89
    assert d["relative"] == pytest.approx((0.5 / 3) / (3.1 / 3))  # +16 %
    assert d["met"] is True and d["target"] == ">= +8% at > 2 σ"
    # Large but noisy: the relative gain is there, the 2 σ is not.
    noisy = bench.paired([1.5, 1.0, 1.4], [1.0, 1.0, 1.0], target=0.08, needs_sigmas=True)
    assert noisy["relative"] > 0.08 and noisy["sigmas"] < 2 and noisy["met"] is False
    # Without the σ condition the relative gain alone decides; below it, not met.
    assert bench.paired([1.5, 1.0, 1.4], [1.0, 1.0, 1.0], target=0.15)["met"] is True
    assert bench.paired([1.1, 1.1], [1.0, 1.0], target=0.15)["met"] is False


def test_paired_with_identical_differences_has_no_sigma_and_refuses_mismatched_seeds(bench):
    d = bench.paired([2.0, 3.0], [1.0, 2.0], target=0.08, needs_sigmas=True)
    assert d["std"] == 0 and d["sigmas"] is None and d["met"] is False  # no spread: σ undefined, not "> 2 σ"
    assert "met" not in bench.paired([2.0], [1.0])
    with pytest.raises(ValueError, match="2 values against 3"):
        bench.paired([1.0, 2.0], [1.0, 2.0, 3.0])


def test_pick_best_breaks_ties_by_the_log_prob_then_the_lower_index(bench):
    assert bench.pick_best([0.1, 0.5, 0.3], [0.0, -9.0, 0.0]) == 1
    assert bench.pick_best([0.5, 0.5, 0.3], [-2.0, -1.0, 0.0]) == 1
    assert bench.pick_best([0.5, 0.5], [-1.0, -1.0]) == 0


def test_split_flat_cuts_pool_scores_back_per_source(bench):
    parts = bench.split_flat([1, 2, 3, 4, 5, 6], [1, 3, 2])
    assert [p.tolist() for p in parts] == [[1], [2, 3, 4], [5, 6]]
    with pytest.raises(ValueError, match="5 values for pools of 6"):
        bench.split_flat([1, 2, 3, 4, 5], [3, 3])


def test_algorithms_args_repeat_a_saved_results_training_settings(bench):
    settings = {"rl_epochs": 2, "train_subset": 512, "batch_size": 32, "overrides": ["run.log_every=1"],
                "base_overrides": ["synth.test_fraction=0.1"], "heldout": 3200, "fresh_sources": 0, "rl_split": 0.0}
    args = bench.algorithms_args("docstrings", Path("/w"), [2, 3], settings)
    assert args == ["--task", "docstrings", "--workdir", "/w", "--seeds", "2,3", "--arms", "continued_sft,grpo",
                    "--rl-epochs", "2", "--train-subset", "512", "--batch-size", "32", "--no-save",
                    "--override", "run.log_every=1", "--base-override", "synth.test_fraction=0.1"]
    with pytest.raises(ValueError, match="rl_split"):
        bench.algorithms_args("docstrings", Path("/w"), [1], {**settings, "rl_split": 0.3})


FIRST_PROTOCOL = ("greedy", "beam", "mean_logprob", "mbr_task_score", "mbr_rouge_l", "mbr_task_score_prob", "reward",
                  "reward_lr1e-3", "oracle")
"""The methods of a task measured before the epsilon pool was added."""
SECOND_PROTOCOL = FIRST_PROTOCOL + ("mbr_task_score_eps", "oracle_eps")
"""... and before its 64-sample pool was."""
THIRD_PROTOCOL = SECOND_PROTOCOL + ("mbr_task_score_eps64", "oracle_eps64")
"""... and before beam search with the repetition controls was."""
ALL = THIRD_PROTOCOL + ("beam_norepeat3",)


def _reading(scores: dict[str, float], methods) -> dict:
    return {"methods": {m: {"metrics": {"task_score": scores.get(m, 1.0), "rouge_l": 0.5}, "seconds_per_source": 0.01,
                            "wall_seconds_per_source": 0.02, "seconds_per_source_parts": {"decode": 0.01}}
                        for m in methods}}


def _readings(methods=ALL) -> dict:
    return {str(s): {"reward_models": {},
                     "sft": _reading({"greedy": 1.0, "beam": 1.0, "mbr_task_score": 1.1 + 0.01 * s,
                                      "mbr_task_score_eps": 1.05, "mbr_task_score_eps64": 1.1 + 0.03 * s,
                                      "beam_norepeat3": 1.05}, methods),
                     "grpo": _reading({"greedy": 1.1, "beam": 1.1, "mbr_task_score": 1.25 + 0.01 * s}, methods)}
            for s in (3, 1, 2)}


def test_flat_readings_give_one_record_per_seed_model_and_method(bench):
    records = bench.flat_readings(_readings())
    assert len(records) == 3 * 2 * len(bench.METHODS)
    first = records[0]
    assert (first["seed"], first["model"], first["method"]) == (1, "sft", "greedy")  # seeds in order
    assert first["task_score"] == 1.0 and first["cpu_seconds_per_source"] == 0.01
    assert first["wall_seconds_per_source"] == 0.02 and first["cpu_parts"] == {"decode": 0.01}


def test_summarize_gives_every_method_and_the_two_targets(bench):
    s = bench.summarize(bench.flat_readings(_readings()))
    assert s["seeds"] == "1, 2, 3"
    assert len(s["rows"]) == 2 * len(bench.METHODS)
    row = next(r for r in s["rows"] if (r["model"], r["method"]) == ("sft", "mbr_task_score"))
    assert row["task_score"] == pytest.approx(1.12) and row["task_score_std"] == pytest.approx(0.01)
    assert row["cpu_ms_per_source"] == pytest.approx(10.0) and row["wall_ms_per_source"] == pytest.approx(20.0)
    by = {(d["comparison"], d["metric"]): d for d in s["paired"]}
    sft_mbr = by[("sft: mbr_task_score - beam", "task_score")]
    assert sft_mbr["mean"] == pytest.approx(0.12) and sft_mbr["met"] is True
    rl_mbr = by[("grpo mbr_task_score - sft greedy", "task_score")]
    assert rl_mbr["relative"] == pytest.approx(0.27) and rl_mbr["met"] is True
    assert "met" not in by[("sft: mbr_task_score - beam", "rouge_l")]  # the targets are on the task score


def test_summarize_refuses_a_seed_without_every_method(bench):
    records = [r for r in bench.flat_readings(_readings()) if not (r["seed"] == 2 and r["method"] == "oracle")]
    with pytest.raises(ValueError, match=r"\(2, 'sft', 'oracle'\)"):
        bench.summarize(records)


def test_a_task_measured_before_a_method_was_added_is_summarised_without_it(bench):
    assert bench.METHODS == ALL
    old = bench.summarize(bench.flat_readings(_readings(FIRST_PROTOCOL)))
    assert [r["method"] for r in old["rows"] if r["model"] == "sft"] == list(FIRST_PROTOCOL)
    assert not [d for d in old["paired"] if "_eps" in d["comparison"]]  # left out, not invented
    assert any(d["comparison"] == "sft: mbr_task_score - beam" for d in old["paired"])
    second = bench.summarize(bench.flat_readings(_readings(SECOND_PROTOCOL)))
    assert [r["method"] for r in second["rows"] if r["model"] == "sft"] == list(SECOND_PROTOCOL)
    assert any("_eps - " in d["comparison"] for d in second["paired"])
    assert not [d for d in second["paired"] if "eps64" in d["comparison"]]
    new = bench.summarize(bench.flat_readings(_readings()))
    by = {(d["comparison"], d["metric"]): d for d in new["paired"]}
    eps = by[("sft: mbr_task_score_eps - beam", "task_score")]
    assert eps["relative"] == pytest.approx(0.05) and eps["met"] is False and eps["target"] == ">= +8% at > 2 σ"
    assert by[("sft: mbr_task_score_eps - mbr_task_score", "task_score")]["mean"] == pytest.approx(-0.07)
    # The 64-sample pool: #41's targets for it, and its paired difference with the 16-sample epsilon pool.
    big = by[("sft: mbr_task_score_eps64 - beam", "task_score")]
    assert big["mean"] == pytest.approx(0.16) and big["target"] == ">= +8% at > 2 σ" and big["met"] is True
    assert by[("sft: mbr_task_score_eps64 - mbr_task_score_eps", "task_score")]["mean"] == pytest.approx(0.11)
    assert ("grpo mbr_task_score_eps64 - sft greedy", "task_score") in by
    # The fourth protocol: what the repetition controls did to beam, and #41's MBR target against that beam.
    assert by[("sft: beam_norepeat3 - beam", "task_score")]["mean"] == pytest.approx(0.05)
    against = by[("sft: mbr_task_score_eps64 - beam_norepeat3", "task_score")]
    assert against["mean"] == pytest.approx(0.11) and against["target"] == ">= +8% at > 2 σ"
    assert ("grpo: mbr_task_score - beam_norepeat3", "task_score") in by
    third = bench.summarize(bench.flat_readings(_readings(THIRD_PROTOCOL)))
    assert not [d for d in third["paired"] if "norepeat" in d["comparison"]]
    with pytest.raises(ValueError, match=r"unknown method\(s\) \['mbr_typo'\]"):
        bench.summarize([{**r, "method": "mbr_typo"} for r in bench.flat_readings(_readings())][:1])


def test_work_seconds_add_every_cached_stage_and_are_unknown_when_one_was_not_recorded(bench):
    readings = {"1": {"reward_models": {"reward": {"seconds": 100.0}}, "sft": {"decode_seconds": 20.0},
                      "grpo": {"decode_seconds": 30.5}},
                "2": {"reward_models": {}, "sft": {"decode_seconds": 1.0}, "grpo": {"decode_seconds": 2.0}}}
    assert bench.work_seconds(readings) == pytest.approx(153.5)
    del readings["2"]["grpo"]["decode_seconds"]  # a cache written before the field
    assert bench.work_seconds(readings) is None


def test_task_settings_changed_only_when_the_saved_ones_are_not_the_current_tail(bench):
    current = ["model.family=bart", "sft.patience=0", "tokenizer.kind=subword", "sft.epochs=16"]
    assert not bench.settings_changed(["tokenizer.kind=subword", "sft.epochs=16"], current)  # saved before the pins
    assert not bench.settings_changed(current, current)
    assert bench.settings_changed(["tokenizer.kind=subword", "sft.epochs=8"], current)
    assert bench.settings_changed(["x=1", *current], current)
