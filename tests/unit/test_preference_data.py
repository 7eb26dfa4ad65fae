"""The pairs of the offline preference algorithms: from preference files (each list weighing as one pair),
from scored samples (best over worst, ties left out), and the run's pairs file, which a resume reads back."""

from __future__ import annotations

import pytest

from rlt2t.common.algorithms import PreferenceSettings
from rlt2t.common.data import DataError
from rlt2t.common.types import SampledGroup, ScoredGroup
from rlt2t.preference_data import best_worst_pairs, file_pairs, read_pairs_file, write_pairs_file


def test_file_pairs_weigh_each_list_as_one_pair(tmp_path):
    ranks = tmp_path / "ranks.tsv"
    ranks.write_text("src one\tbest\tmiddle\tworst\n")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"source": "src two", "chosen": "good", "rejected": "bad"}\n')
    got = file_pairs(PreferenceSettings(rank_lists=[str(ranks)], pairs=[str(pairs)]))
    assert [(p.source, p.chosen, p.rejected) for p in got] == [
        ("src one", "best", "middle"), ("src one", "best", "worst"), ("src one", "middle", "worst"),
        ("src two", "good", "bad")]
    assert [p.weight for p in got] == pytest.approx([1 / 3, 1 / 3, 1 / 3, 1.0])
    assert got[0].example_id == f"{ranks}:1#0"
    assert file_pairs(PreferenceSettings()) == []
    with pytest.raises(FileNotFoundError, match=r"^rl.dpo.ratings: file not found: .*nope.jsonl$"):
        file_pairs(PreferenceSettings(rank_lists=[str(ranks)], ratings=[str(tmp_path / "nope.jsonl")]), "rl.dpo")


def _scored(example_id, candidates, rewards):
    group = SampledGroup(example_id, "s " + example_id, "ref", tuple(candidates), tuple((1,) for _ in candidates),
                         tuple((0.0,) for _ in candidates), tuple(False for _ in candidates), 0)
    return ScoredGroup(group, tuple(rewards))


def test_best_worst_pairs_leave_ties_out():
    pairs, ties = best_worst_pairs([
        _scored("a", ["x", "y", "z"], [0.1, 0.9, 0.0]),
        _scored("b", ["x", "y"], [0.5, 0.5]),          # rewards tie
        _scored("c", ["same", "same"], [1.0, 0.0]),    # texts tie
        _scored("d", ["p", "q", "r"], [0.2, 0.7, 0.7]),  # first of the best, first of the worst
    ])
    assert [(p.example_id, p.chosen, p.rejected) for p in pairs] == [("a", "y", "z"), ("d", "q", "p")]
    assert ties == 2


def test_the_pairs_file_round_trips_and_names_a_bad_line(tmp_path):
    pairs, _ = best_worst_pairs([_scored("a", ["x", "y"], [1.0, 0.0])])
    path = tmp_path / "rl" / "preference_pairs.jsonl"
    write_pairs_file(path, pairs)
    assert read_pairs_file(path) == pairs
    path.write_text(path.read_text() + '{"id": "b", "source": "s", "chosen": "c", "rejected": "r", "weight": -1}\n')
    with pytest.raises(DataError, match=r"preference_pairs.jsonl:2: field 'weight': must be a positive number"):
        read_pairs_file(path)
