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


def test_cli_logs_go_to_the_stderr_of_the_moment(monkeypatch):
    """`rlt2t` commands run in-process (a notebook, a test) may replace sys.stderr and close the old one between
    calls: the logs follow the current stream instead of failing on the closed one."""
    import io
    import logging

    from rlt2t.common.tracking import setup_logging

    first = io.StringIO()
    monkeypatch.setattr("sys.stderr", first)
    setup_logging()
    logging.getLogger("rlt2t.test").info("to the first")
    first.close()
    second = io.StringIO()
    monkeypatch.setattr("sys.stderr", second)
    setup_logging()  # idempotent: still one handler of ours
    logging.getLogger("rlt2t.test").info("to the second")
    assert "rlt2t.test: to the second" in second.getvalue() and "Logging error" not in second.getvalue()
    assert sum(getattr(h, "_rlt2t", False) for h in logging.getLogger().handlers) == 1
