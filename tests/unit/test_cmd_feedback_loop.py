"""`rlt2t feedback-loop` wiring: the command runs the loop on the config it was given and prints one table row
per round (the loop itself is tested end to end in tests/integration/test_feedback_loop.py)."""

from __future__ import annotations

from rlt2t import feedback
from rlt2t.cli import main


def test_feedback_loop_command_runs_the_loop_and_prints_a_row_per_round(monkeypatch, tmp_path, capsys):
    seen = []
    rounds = [{"round": r, "token": "17", "reward_model_pair_accuracy": acc,
               "before": {"preference": 0.25, "hit_rate": 0.125},
               "after": {"preference": 0.5 + r / 8, "hit_rate": 0.375, "kl_per_sequence": 1.5, "kl_per_token": 0.25}}
              for r, acc in ((1, 0.875), (2, None))]

    def fake_loop(cfg):
        seen.append(cfg)
        return rounds

    monkeypatch.setattr(feedback, "run_loop", fake_loop)
    assert main(["feedback-loop", f"run.dir={tmp_path}", "feedback.rounds=2"]) == 0
    out = capsys.readouterr().out
    assert len(seen) == 1 and seen[0].feedback.rounds == 2 and seen[0].run_dir == tmp_path
    assert "scripted annotator prefers token '17'" in out
    lines = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
             for line in out.splitlines() if line.count("│") > 2 and "round" in line}
    assert lines["round 1"] == ["0.8750", "0.2500", "0.6250", "0.1250", "0.3750", "1.5000", "0.2500"]
    assert lines["round 2"][:3] == ["nan", "0.2500", "0.7500"]  # no held-out pairs: the accuracy is NaN
