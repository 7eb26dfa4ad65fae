"""Reward server, Python reward terms (``reward.named`` with ``kind: python``): served by name with their
params, a function that does not import stops the server from starting, a function that fails is a 500 naming
the term and the source."""

from __future__ import annotations

import re
import textwrap

import pytest
from fastapi.testclient import TestClient

from rlt2t.common.config import ConfigError, load_config
from rlt2t.services.reward_app import create_app

SOURCES = ["1 2 3", "4 5"]
CANDS = ["11 12 13 14", "20"]


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "served_rewards_mod.py").write_text(textwrap.dedent("""
        def length(sources, candidates, references, scale=1.0):
            return [scale * len(c.split()) for c in candidates]

        def overlap(source, candidate, references):
            return max((len(set(candidate.split()) & set(r.split())) for r in references), default=0)

        def broken(sources, candidates, references):
            return [1.0 / (len(c.split()) - 1) for c in candidates]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def served(run, named: str):
    return load_config([], [f"run.dir={run}", "reward.device=cpu", f"reward.named={named}"])


def test_a_python_term_is_served_by_name_with_and_without_references(plugin):
    cfg = served(plugin, "{length: [{kind: python, fn: 'served_rewards_mod:length', params: {scale: 0.5}}], "
                         "overlap: [{kind: python, fn: 'served_rewards_mod:overlap', per_sample: true}]}")
    with TestClient(create_app(cfg)) as client:
        r = client.post("/v1/reward", json={"candidates": CANDS, "sources": SOURCES, "metrics": ["length"]})
        assert r.status_code == 200, r.text
        assert r.json()["scores"] == {"length": [2.0, 0.5]}
        r = client.post("/v1/reward", json={"candidates": CANDS, "sources": SOURCES, "references": [["11 13"], "21"],
                                            "metrics": ["overlap", "length"]})
        assert r.status_code == 200, r.text
        assert r.json()["scores"] == {"overlap": [2.0, 0.0], "length": [2.0, 0.5]}


def test_a_function_that_fails_is_a_500_naming_the_term_and_the_source(plugin):
    cfg = served(plugin, "{broken: [{kind: python, fn: 'served_rewards_mod:broken'}]}")
    with TestClient(create_app(cfg), raise_server_exceptions=False) as client:
        r = client.post("/v1/reward", json={"candidates": CANDS, "sources": SOURCES, "metrics": ["broken"]})
    assert r.status_code == 500
    # The line that raised, by the file's name (in a list comprehension: Python 3.11 names its frame <listcomp>).
    assert re.fullmatch(r"reward term python:served_rewards_mod:broken raised ZeroDivisionError: float division by "
                        r"zero at served_rewards_mod\.py:9 in \S+ `return \[1\.0 / \(len\(c\.split\(\)\) - 1\) "
                        r"for c in candidates\]` \(first failing source: '4 5', candidate 1: '20'\)",
                        r.json()["detail"]), r.json()["detail"]


def test_a_function_that_does_not_import_stops_the_server_at_start(tmp_path):
    cfg = served(tmp_path, "{mine: [{kind: python, fn: 'not_a_module_xyz:length'}]}")
    with pytest.raises(ConfigError, match=r"reward.named.mine\[0\] \(python:not_a_module_xyz:length\) "
                                          r"'not_a_module_xyz:length': cannot import module"):
        create_app(cfg)
