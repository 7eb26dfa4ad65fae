"""Preference files: rank lists, pairs and ratings become groups of ordered pairs; bad lines name file:line."""

from __future__ import annotations

import json

import pytest

from rlt2t.common.data import DataError
from rlt2t.common.preferences import (
    load_preferences,
    read_pairs,
    read_rank_lists,
    read_ratings,
    split_by_source,
    write_pairs,
    write_rank_lists,
)


def test_rank_list_gives_every_ordered_pair(tmp_path):
    path = tmp_path / "lists.tsv"
    path.write_text("src one\tbest\tmiddle\tworst\n\nsrc two\ta\tb\n")
    first, second = read_rank_lists(path)
    assert first.source == "src one" and first.candidates == ("best", "middle", "worst")
    assert first.pairs == ((0, 1), (0, 2), (1, 2))  # K choose 2, better first
    assert second.pairs == ((0, 1),)
    assert first.origin == f"{path}:1" and second.origin == f"{path}:3"


def test_written_rank_lists_and_pairs_read_back(tmp_path):
    lists = [("s 1", ["x y", "x", "y z w"]), ("s 2", ["p", "q"])]
    assert write_rank_lists(tmp_path / "l.tsv", lists) == 2
    assert [(g.source, list(g.candidates)) for g in read_rank_lists(tmp_path / "l.tsv")] == lists
    assert write_pairs(tmp_path / "p.jsonl", [("s", "good", "bad")]) == 1
    (g,) = read_pairs(tmp_path / "p.jsonl")
    assert (g.source, g.candidates, g.pairs) == ("s", ("good", "bad"), ((0, 1),))


@pytest.mark.parametrize(("lists", "match"), [
    ([("s", ["a\tb", "c"])], r"lists\[0\].candidates\[0\]: contains a tab"),
    ([("s\nx", ["a", "c"])], r"lists\[0\].source: contains a tab or a line break"),
    ([("s", ["a"])], r"lists\[0\]: a rank list needs >= 2 distinct"),
    ([("s", ["a", "a"])], r"lists\[0\]: a rank list needs >= 2 distinct"),
])
def test_writer_refuses_what_the_format_cannot_hold(tmp_path, lists, match):
    with pytest.raises(ValueError, match=match):
        write_rank_lists(tmp_path / "l.tsv", lists)
    assert not (tmp_path / "l.tsv").exists()  # atomic: nothing half-written


def test_ratings_become_pairs_within_a_source(tmp_path):
    path = tmp_path / "r.jsonl"
    rows = [{"source": "s1", "candidate": "a", "rating": 1.0}, {"source": "s2", "candidate": "x", "rating": 0},
            {"source": "s1", "candidate": "b", "rating": 2}, {"source": "s1", "candidate": "c", "rating": 1.0},
            {"source": "s2", "candidate": "y", "rating": 0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (g,) = read_ratings(path)  # s2's ratings all tie: nothing to learn, dropped
    assert g.source == "s1" and g.candidates == ("a", "b", "c")
    assert set(g.pairs) == {(1, 0), (1, 2)}  # b over a and over c; a and c tie: no pair
    assert g.origin == f"{path}:1"


@pytest.mark.parametrize(("reader", "text", "match"), [
    (read_rank_lists, "src\tonly one\n", r":1: field 'candidates': a rank list needs >= 2"),
    (read_rank_lists, "ok\ta\tb\n\tx\ty\n", r":2: field 'source': empty"),
    (read_rank_lists, "s\ta\t \n", r":1: field 'candidate 2': empty"),
    (read_rank_lists, "s\ta\tb\ta\n", r":1: field 'candidate 3': repeats candidate 1"),
    (read_pairs, '{"source": "s", "chosen": "a"}\n', r":1: field 'rejected': missing"),
    (read_pairs, '{"source": "s", "chosen": "a", "rejected": "a"}\n', r":1: field 'rejected': equals chosen"),
    (read_pairs, '{"source": "s", "chosen": 3, "rejected": "a"}\n', r":1: field 'chosen': must be a string"),
    (read_pairs, "not json\n", r":1: not valid JSON"),
    (read_pairs, "[1, 2]\n", r":1: expected a JSON object"),
    (read_ratings, '{"source": "s", "candidate": "a", "rating": "high"}\n', r":1: field 'rating': must be a finite"),
    (read_ratings, '{"source": "s", "candidate": "a", "rating": true}\n', r":1: field 'rating': must be a finite"),
    (read_ratings, '{"source": "s", "candidate": "a", "rating": NaN}\n', r":1: field 'rating': must be a finite"),
    (read_ratings, '{"source": "s", "candidate": "a", "rating": 1}\n{"source": "s", "candidate": "a", "rating": 2}\n',
     r":2: field 'candidate': already rated for this source on line 1"),
])
def test_bad_lines_name_file_line_and_field(tmp_path, reader, text, match):
    path = tmp_path / "bad.txt"
    path.write_text(text)
    with pytest.raises(DataError, match=match) as e:
        reader(path)
    assert str(e.value).startswith(str(path))


def test_a_byte_order_mark_is_dropped_and_a_bad_byte_is_named_with_its_line(tmp_path):
    lists = tmp_path / "lists.tsv"
    lists.write_bytes(b"\xef\xbb\xbfsrc\ta\tb\n")
    assert read_rank_lists(lists)[0].source == "src"
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_bytes(b'\xef\xbb\xbf{"source": "s", "chosen": "a", "rejected": "b"}\n')
    assert len(read_pairs(pairs)) == 1
    lists.write_bytes(b"src\ta\tb\ns\xe9c\ta\tb\n")  # Latin-1, not UTF-8
    with pytest.raises(DataError, match=r"lists.tsv:2: not valid UTF-8"):
        read_rank_lists(lists)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.tsv"):
        load_preferences(rank_lists=[tmp_path / "nope.tsv"])


def test_split_keeps_each_source_on_one_side_and_is_seeded(tmp_path):
    path = tmp_path / "l.tsv"
    write_rank_lists(path, [(f"s {i % 40}", [f"a {i}", f"b {i}"]) for i in range(200)])
    groups = load_preferences(rank_lists=[path])
    train, valid = split_by_source(groups, 0.25, seed=3)
    assert {g.source for g in train}.isdisjoint({g.source for g in valid})
    assert len(train) + len(valid) == 200 and 0.1 < len(valid) / 200 < 0.45
    assert split_by_source(groups, 0.25, seed=3) == (train, valid)
    assert split_by_source(groups, 0.25, seed=4) != (train, valid)
    assert split_by_source(groups, 0.0, seed=3) == (groups, [])


def test_texts_under_the_tokenizers_token_rule(tmp_path, ids_tokenizer_dir):
    """A special token in a preference text would reach the reward model as a control token: refused, named."""
    from rlt2t.common.preferences import check_preference_texts
    from rlt2t.common.tokenization import load_tokenizer, text_checker

    check = text_checker(load_tokenizer(ids_tokenizer_dir))
    lists = tmp_path / "lists.tsv"
    lists.write_text("12 13\t14\t15\n12 14\t16 </s>\t17\n")
    groups = read_rank_lists(lists)
    check_preference_texts(groups[:1], check)  # fine
    with pytest.raises(DataError, match=r"lists.tsv:2: field 'candidate 1': special token"):
        check_preference_texts(groups, check)


def test_files_that_share_preferences_are_warned_about(tmp_path, caplog):
    """The annotation export's rank lists and pairs hold the same preferences: both passed, each counts twice."""
    ranked = [("1 2", ["3", "4", "5"]), ("6", ["7", "8"])]
    write_rank_lists(tmp_path / "ranks.tsv", ranked)
    write_pairs(tmp_path / "pairs.jsonl", [(s, c[i], c[j]) for s, c in ranked for i in range(len(c))
                                           for j in range(i + 1, len(c))])
    write_pairs(tmp_path / "other.jsonl", [("9", "10", "11")])
    with caplog.at_level("WARNING", logger="rlt2t.preferences"):
        groups = load_preferences(rank_lists=[tmp_path / "ranks.tsv"], pairs=[tmp_path / "other.jsonl"])
    assert len(groups) == 3 and not caplog.records  # nothing shared: no warning
    with caplog.at_level("WARNING", logger="rlt2t.preferences"):
        load_preferences(rank_lists=[tmp_path / "ranks.tsv"],
                         pairs=[tmp_path / "pairs.jsonl", tmp_path / "other.jsonl"])
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "ranks.tsv and" in warning and "pairs.jsonl share 4 preferences (of 4 and 4)" in warning
