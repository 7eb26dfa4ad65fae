"""Tests for rlt2t.actors.reward: pair ordering, ties, the shipped CIDEr-D df, vectorised scoring."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rlt2t.actors.reward import RewardWorker
from rlt2t.common.config import RewardConfig
from rlt2t.common.metrics import DocumentFrequency, get_metric
from rlt2t.common.types import CandidateSet

TRAIN_REFS = ["11 12 13 14 15", "11 12 20 21", "30 31 32 33 34 35", "12 13 14 40", "50 51 52 53"]


@pytest.fixture(scope="module")
def df() -> DocumentFrequency:
    return DocumentFrequency.from_references([[r] for r in TRAIN_REFS])


def cset(pair: tuple[str, str], reference: str = "11 12 13 14 15", example_id: str = "x", version: int = 3):
    return CandidateSet(example_id=example_id, source="1 2 3", reference=reference,
                        candidates=tuple(dict.fromkeys(pair)), pair=pair, policy_version=version)


def test_better_candidate_becomes_a_in_either_draw_order(df):
    worker = RewardWorker(RewardConfig(), df)
    good, bad = "11 12 13 14 15", "11 12 99 98"
    for pair in ((good, bad), (bad, good)):
        (p,) = worker.score([cset(pair)])
        assert (p.a, p.b) == (good, bad)
        assert p.score_a > p.score_b and p.use_rank
        assert (p.example_id, p.source, p.reference, p.policy_version) == ("x", "1 2 3", "11 12 13 14 15", 3)


def test_scores_are_the_configured_task_score(df):
    cfg = RewardConfig(bleu_weight=0.5, cider_sigma=2.0)
    (p,) = RewardWorker(cfg, df).score([cset(("11 12 13 14 15", "11 12 13"))])
    expected = get_metric("task_score", bleu_weight=0.5, sigma=2.0, df=df).per_sample(
        ["11 12 13 14 15", "11 12 13"], [["11 12 13 14 15"]] * 2
    )
    assert (p.score_a, p.score_b) == tuple(expected.tolist())
    # The settings reach the metric: the default settings score the shorter text differently.
    (default,) = RewardWorker(RewardConfig(), df).score([cset(("11 12 13 14 15", "11 12 13"))])
    assert default.score_b != p.score_b


def test_equal_strings_and_exact_ties_turn_ranking_off(df):
    worker = RewardWorker(RewardConfig(), df)
    same, tie = worker.score([cset(("11 12 13", "11 12 13")), cset(("70 71", "80 81 82"))])
    assert same.a == same.b and not same.use_rank
    # Neither text shares an n-gram with the reference: both score exactly 0.
    assert tie.score_a == tie.score_b == 0.0 and tie.a != tie.b and not tie.use_rank
    assert (tie.a, tie.b) == ("70 71", "80 81 82")  # a tie keeps the drawn order


def test_vectorised_scores_equal_one_set_at_a_time(df):
    worker = RewardWorker(RewardConfig(), df)
    sets = [
        cset(("11 12 13 14 15", "11 12 99"), example_id="a"),
        cset(("30 31 32", "30 31 32 33 34 35"), reference="30 31 32 33 34 35", example_id="b"),
        cset(("12 13 14", "12 13 14"), reference="12 13 14 40", example_id="c"),
        cset(("50 51", "51 52 53"), reference="50 51 52 53", example_id="d"),
    ]
    assert worker.score(sets) == [worker.score([s])[0] for s in sets]
    assert worker.score([]) == []


def test_shipped_df_file_equals_object_and_differs_from_a_batch_df(df, tmp_path):
    path = tmp_path / "df.json"
    df.save(path)
    sets = [cset(("11 12 13 14 15", "11 12 99")), cset(("30 31 32", "50 51"), reference="30 31 32 33 34 35")]
    from_object = RewardWorker(RewardConfig(), df).score(sets)
    assert RewardWorker(RewardConfig(), str(path)).score(sets) == from_object
    assert RewardWorker(RewardConfig(), path).score(sets) == from_object
    # The documented reason a df must be shipped: a df counted from the scored batch itself (the coco
    # default) gives the same pair another reward depending on its batch mates.
    batch_df = get_metric("task_score", df=None)
    hyp, ref = ["11 12 13 14 15"], [["11 12 13 14 15"]]
    alone = batch_df.per_sample(hyp, ref)[0]
    with_mates = batch_df.per_sample(hyp + ["30 31"], ref + [["30 31 32 33 34 35"]])[0]
    assert alone != with_mates
    with pytest.raises(TypeError, match="document_frequency"):
        RewardWorker(RewardConfig(), None)  # type: ignore[arg-type]


def test_reward_config_rejects_impossible_values():
    with pytest.raises(ValidationError, match="bleu_weight"):
        RewardConfig(bleu_weight=1.5)
    with pytest.raises(ValidationError, match="cider_sigma"):
        RewardConfig(cider_sigma=0.0)


def test_a_reward_of_reference_metrics_scores_without_importing_torch_or_transformers(tmp_path):
    """The default reward worker (task score, reward.device=auto), as an RL job launches it (with its
    object-store mixin), and the HTTP workers start without the multi-second torch and transformers imports:
    every RL job starts one or more of them beside the learners and rollout workers."""
    import subprocess
    import sys

    script = """
import sys
from rlt2t.actors.reward import RewardWorker
from rlt2t.by_reference import RewardsByReference, RolloutsByReference, with_results
from rlt2t.common.config import RewardConfig
from rlt2t.common.metrics import DocumentFrequency
from rlt2t.common.types import CandidateSet
from rlt2t.services.remote_workers import HttpRewardWorker, HttpRolloutWorker
launched = with_results(RewardWorker, RewardsByReference)
worker = launched(RewardConfig(), DocumentFrequency.from_references([["1 2 3"], ["4 5"]]))
summary, scored = worker.score_stored([CandidateSet("e", "9 9", "1 2 3", ("4 5", "1 2 3"), ("4 5", "1 2 3"), 0)])
pair = scored[0]
assert launched.__name__ == "RewardWorker" and summary == [("e", 0, None)], summary
assert pair.a == "1 2 3" and pair.score_a > pair.score_b, pair
with_results(HttpRolloutWorker, RolloutsByReference), with_results(HttpRewardWorker, RewardsByReference)
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
