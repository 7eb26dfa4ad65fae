"""The human-feedback loop end to end on a tiny run: a scripted annotator's hidden preference is learned by
the reward model (held-out pair accuracy >= 0.9), RL with that reward model raises it on held-out sources
while the KL to the starting policy stays bounded; the reward server serves the loop's reward model by name
and scores as the in-process reward does; the CLI names bad preference lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlt2t.cli import main
from rlt2t.common.config import HttpTerm, load_config
from rlt2t.common.preferences import read_rank_lists
from rlt2t.common.rewards import HttpReward, RewardModelReward
from rlt2t.feedback import run_loop
from rlt2t.services.reward_app import create_app

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
OVERRIDES = [
    # Measured with post-norm BART on 450 training rows and random SFT batches (the defaults before the demo's
    # changed); the reward model at the tiny preset in mBART's layout held out 0.68 of the pairs, not 0.9, and from
    # the SFT of batches grouped by length the RL policy ended 2.15 nats a sequence from its start, not under 2.
    "model.family=bart", "sft.group_by_length=false",
    "synth.size=600", "synth.valid_fraction=0.2", "synth.test_fraction=0.05",
    "pretrain.enabled=false", "metric.monitor_size=0",
    "feedback.sources=500", "feedback.num_candidates=8", "feedback.eval_sources=120",
    "reward_model.epochs=8", "reward_model.lr=3e-3", "reward_model.dropout=0",
    "rl.train_subset=256", "rl.epochs=2", "rl.algorithm=grpo", "rl.kl.coef=0.2", "rl.lr=2e-4",
]


@pytest.fixture(scope="module")
def loop(ray_session, tmp_path_factory):
    run = tmp_path_factory.mktemp("feedback")
    cfg = load_config([REPO / "configs" / "tiny.yaml"], [f"run.dir={run}", *OVERRIDES])
    return cfg, run_loop(cfg)


def test_reward_model_learns_the_preference_and_rl_raises_it(loop):
    cfg, (summary,) = loop
    round_dir = cfg.run_dir / "feedback" / "round-1"
    lists = read_rank_lists(round_dir / "rank_lists.tsv")  # the annotation export's format, read back
    assert len(lists) == summary["ranked_sources"] > 100
    assert all(t.split().count(summary["token"]) > 0 for g in lists for t in g.candidates[:1])
    assert summary["reward_model_pair_accuracy"] >= 0.9
    assert (cfg.run_dir / "feedback" / "round-1" / "logs" / "reward_model" / "curves.png").is_file()
    before, after = summary["before"], summary["after"]
    assert before["kl_per_sequence"] == 0.0  # the start measured against itself
    assert after["preference"] >= before["preference"] + 0.1, (before, after)
    assert after["hit_rate"] > before["hit_rate"]
    assert 0.0 < after["kl_per_sequence"] < 2.0, after  # bounded: the policy moved, but not far


def test_reward_server_serves_the_loops_reward_model_by_name(loop, live_server, monkeypatch):
    cfg, (summary,) = loop
    monkeypatch.delenv("RLT2T_API_TOKEN", raising=False)
    root = cfg.run_dir / "feedback" / "round-1" / "reward_model" / "checkpoints"
    serve_cfg = load_config([], [f"run.dir={cfg.run_dir}", "model.preset=tiny", "reward.device=cpu",
                                 f"reward.named={{prefs: [{{kind: reward_model, path: '{root}'}}]}}"])
    group = read_rank_lists(cfg.run_dir / "feedback" / "round-1" / "rank_lists.tsv")[0]
    sources, candidates = [group.source] * len(group.candidates), list(group.candidates)
    local = RewardModelReward(root).score(sources, candidates)
    with live_server(create_app(serve_cfg)) as server:
        remote = HttpReward(HttpTerm(url=server.url, name="prefs")).score(sources, candidates)
    assert remote.tolist() == pytest.approx(local.tolist(), abs=1e-6)
    assert list(local) == sorted(local, reverse=True)  # the rank list's order, best first


def test_cli_names_the_bad_line(tmp_path, capsys):
    bad = tmp_path / "lists.tsv"
    bad.write_text("src\ta\tb\nsrc two\tonly\n")
    code = main(["reward-model", "train", "--rank-lists", str(bad), f"run.dir={tmp_path}", "--init", str(tmp_path)])
    assert code == 2
    assert f"{bad}:2: field 'candidates': a rank list needs >= 2" in capsys.readouterr().err
