"""Run logs after a crash: a metrics line cut short by a kill neither corrupts the resumed run's log nor
breaks its curves."""

from __future__ import annotations

import json

import pytest

from rlt2t.common.io import JsonlAppender
from rlt2t.common.plots import plot_curves
from rlt2t.common.tracking import RunLogger


@pytest.mark.parametrize("torn", ['{"step": 3, "lo', '{"step"', ""])
def test_a_resumed_log_cuts_off_the_line_a_crash_left_unfinished(tmp_path, torn):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n' + torn)
    log = JsonlAppender(path)
    assert log.dropped_partial_line == bool(torn)
    log.write({"step": 3})
    log.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]


def test_a_log_that_is_only_a_torn_line_starts_empty(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"st')
    with JsonlAppender(path) as log:
        assert log.dropped_partial_line
        log.write({"step": 1})
    assert path.read_text() == '{"step": 1}\n'


def test_curves_are_drawn_from_the_lines_that_parse(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 1, "loss": 2.0}\n{"kind": "train", "step": 2, "lo\n'
                    '{"kind": "train", "step": 3, "loss": 1.0}\n')
    assert plot_curves(path, tmp_path / "curves.png") == tmp_path / "curves.png"
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_the_run_logger_says_when_it_cut_a_line(tmp_path, caplog):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"ste')
    logger = RunLogger(tmp_path, "rl", tensorboard=False)
    logger.close()
    assert "cut off a line a crash left unfinished" in caplog.text
