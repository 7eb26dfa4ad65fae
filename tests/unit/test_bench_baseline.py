"""The efficacy benchmark's baseline rule (bench/algorithms.py `summarize`), which decides its headline claim.

Every RL arm is compared, seed by seed, with what likelihood training reaches as a user would keep it: of the SFT
checkpoint itself and the continued-SFT arms, the one with the best mean validation score.
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench(bench_script):
    return bench_script("algorithms")


@pytest.fixture(scope="module")
def summarize(bench):
    return bench.summarize


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


def test_a_seed_whose_sft_checkpoint_ignores_its_source_is_flagged(bench, tmp_path, tiny_policy, capsys):
    """A fresh tiny BART says the same (nothing) for every validation source: the bench flags that seed's base
    instead of reading RL arms from it as if it were a trained model."""
    import json

    from rlt2t.common.checkpoint import save_checkpoint
    from rlt2t.common.config import load_config

    cfg = load_config(overrides=[f"run.dir={tmp_path}", "model.preset=tiny", "eval.max_new_tokens=4",
                                 f"tokenizer.path={tiny_policy.tokenizer.name_or_path}"])
    rows = [{"id": str(i), "source": f"{i} {i + 1}", "target": f"{i} {i} {i + 2}"} for i in range(30)]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "valid.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ckpt = save_checkpoint(tmp_path / "ckpt", "epoch-0001", model=tiny_policy.model, tokenizer=tiny_policy.tokenizer,
                           step=1)
    readings = bench._valid_readings(cfg, ckpt, seed=6)
    assert readings["collapsed"] is True and readings["valid_distinct_outputs"] < 0.1
    sft = {6: {**readings, "test_task_score": 0.0, "seconds": 1.0}, 7: _sft(0.5, 0.4)}
    bench.print_summary("synth", [6, 7], 1, 8, sft, [], {}, bench.summarize(sft, {}))
    out = capsys.readouterr().out
    assert "over seeds [7]" in out and "seed 6: the SFT checkpoint writes the same few texts" in out


def _payload(seeds: list[int], *, cpu: str = "Xeon", lr: str = "sft.lr=1e-3") -> dict:
    return {"benchmark": "algorithms", "task": "docstring_names", "machine": {"cpu": cpu, "date": f"d{seeds[0]}"},
            "settings": {"seeds": seeds, "rl_epochs": 2, "train_subset": 8, "task_settings": [lr]},
            "oracles": {}, "total_seconds": 10.0,
            "sft": {str(s): _sft(0.5, 0.40) for s in seeds},
            "arms": {"continued_sft": {str(s): _run(0.45, 0.40 + 0.01 * s) for s in seeds},
                     "grpo": {str(s): _run(0.55, 0.44 + 0.01 * s + 0.002 * s * s) for s in seeds}}}


def test_pooling_a_confirmation_run_recomputes_the_summary_over_every_seed(bench, summarize):
    pooled = bench.pool([_payload([1, 2, 3]), _payload([4, 5])])
    assert pooled["settings"]["seeds"] == [1, 2, 3, 4, 5] and list(pooled["sft"]) == ["1", "2", "3", "4", "5"]
    diffs = [0.04 + 0.002 * s * s for s in (1, 2, 3, 4, 5)]
    each = pooled["summary"]["grpo"]["paired_diff_test_each"]["continued_sft"]
    assert each["mean"] == pytest.approx(sum(diffs) / 5)
    assert pooled["total_seconds"] == 20.0 and [m["date"] for m in pooled["pooled_from"]] == ["d1", "d4"]


@pytest.mark.parametrize(("other", "named"), [
    (_payload([4], cpu="EPYC"), "machine.cpu"),
    (_payload([4], lr="sft.lr=5e-4"), "settings.task_settings"),
    (_payload([3]), "seed 3"),
])
def test_pooling_refuses_what_is_not_the_same_experiment(bench, other, named):
    with pytest.raises(ValueError, match=named):
        bench.pool([_payload([1, 2, 3]), other])


def test_pooling_refuses_a_result_that_lacks_a_setting(bench):
    older = _payload([4])
    del older["settings"]["task_settings"]
    with pytest.raises(ValueError, match="settings.task_settings is None"):
        bench.pool([_payload([1, 2, 3]), older])


def test_a_collapsed_seed_is_left_out_of_the_figures_and_named(bench, summarize):
    sft = {s: _sft(0.5, 0.40) for s in (1, 2, 3)}
    arms = {"continued_sft": {s: _run(0.45, 0.40 + 0.01 * s) for s in (1, 2, 3)},
            "grpo": {s: _run(0.55, 0.44 + 0.01 * s + 0.002 * s * s) for s in (1, 2, 3)}}
    sft[2] = {**_sft(0.05, 0.02), "collapsed": True}
    arms["grpo"][2] = _run(0.30, 0.30)  # RL from a base that learned nothing: a large, meaningless gain
    out = summarize(sft, arms)
    assert out["excluded_seeds"] == [2]
    assert out["grpo"]["paired_diff_test_each"]["continued_sft"]["mean"] == pytest.approx(0.04 + 0.002 * 5)
    assert out["sft"]["test_task_score"]["n"] == 2
    with pytest.raises(ValueError, match="nothing to compare"):
        summarize({1: {**_sft(0.05, 0.02), "collapsed": True}}, {"grpo": {1: _run(0.3, 0.3)}})


def test_rl_split_holds_back_whole_sources_for_rl_and_keeps_every_row_once(bench, tmp_path):
    import json

    refs = {f"name{n}": [f"summary {i} of name{n}" for i in range(1 + n % 3)] for n in range(20)}
    rows = [{"id": f"{name}:{i}", "source": name, "target": ref, "references": refs[name]}
            for name in refs for i, ref in enumerate(refs[name])]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sft_path, rl_path = bench.rl_split(train, 0.25)
    sft = [json.loads(x) for x in sft_path.read_text().splitlines()]
    rl = [json.loads(x) for x in rl_path.read_text().splitlines()]
    assert len({r["source"] for r in rl}) == 5  # a quarter of the 20 sources, each with all of its rows
    assert not {r["source"] for r in sft} & {r["source"] for r in rl}
    assert sorted(r["id"] for r in sft + rl) == sorted(r["id"] for r in rows)
    before = rl_path.stat().st_mtime_ns  # a rerun (a resumed benchmark) reuses the split it wrote
    assert bench.rl_split(train, 0.25) == (sft_path, rl_path) and rl_path.stat().st_mtime_ns == before


@pytest.mark.parametrize("fraction", [0.0, 1.0, 0.01])
def test_rl_split_refuses_a_fraction_that_leaves_a_side_empty(bench, tmp_path, fraction):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(f'{{"id": "{i}", "source": "s{i}", "target": "t"}}\n' for i in range(10)))
    with pytest.raises(ValueError, match="--rl-split"):
        bench.rl_split(train, fraction)


def test_the_replay_arm_trains_on_every_training_row_and_needs_the_split(bench, tmp_path):
    import argparse

    from rlt2t.common.config import load_config

    base = load_config(overrides=[f"run.dir={tmp_path / 'seed1' / 'base'}"])
    # A shared stages' setting reaches the arms: their workers build the model the base's checkpoints hold.
    args = argparse.Namespace(task="synth", rl_epochs=1, train_subset=8, batch_size=4, override=[],
                              base_override=["model.family=mbart"])
    rl_rows = tmp_path / "data" / "train_rl.jsonl"
    replay = bench.arm_config(base, "continued_sft:replay", args, rl_rows)
    plain = bench.arm_config(base, "continued_sft", args, rl_rows)
    assert Path(replay.data.train) == rl_rows.with_name("train.jsonl") and Path(plain.data.train) == rl_rows
    assert replay.run_dir != plain.run_dir and replay.rl.algorithm == "rank" and replay.rl.rank.loss_weight == 0
    assert plain.model.family == replay.model.family == "mbart"  # the task's settings pin bart; the override wins
    with pytest.raises(ValueError, match="needs --rl-split"):
        bench.arm_config(base, "continued_sft:replay", args, None)
