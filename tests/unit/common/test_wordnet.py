"""The WordNet definition task: the wndb line format parsed by hand-made lines, and the real data when
Debian's wordnet-base is installed (`make system-deps`; CI installs it)."""

from __future__ import annotations

import json

import pytest

from rlt2t.common.wordnet import definition_pairs, find_wordnet, read_synsets, tokenize, write_wordnet_task

LINES = (
    "  1 This software and database is being provided to you, the LICENSEE, by\n"
    "00001740 03 n 01 entity 0 003 ~ 00001930 n 0000 | that which is perceived or known or inferred to have its own"
    " distinct existence (living or nonliving)\n"
    "09917593 18 n 02 child 0 kid 0 001 @ 09622049 n 0000 | a young person of either sex;"
    ' "she writes books for children"; "they\'re just kids"\n'
    "00011093 00 a 01 able(p) 0 001 ! 00002098 a 0101 | (usually followed by `to') having the necessary means;"
    ' "able to get a grant"\n'
)


@pytest.fixture()
def fake_wordnet(tmp_path):
    (tmp_path / "data.noun").write_text("\n".join(LINES.splitlines()[:3]) + "\n")
    (tmp_path / "data.adj").write_text(LINES.splitlines()[0] + "\n" + LINES.splitlines()[3] + "\n")
    for name in ("data.verb", "data.adv"):
        (tmp_path / name).write_text(LINES.splitlines()[0] + "\n")
    return tmp_path


def test_data_lines_parse_into_lemmas_definition_and_examples(fake_wordnet):
    entity, child = list(read_synsets(fake_wordnet, "noun"))
    assert entity.lemmas == ("entity",) and entity.examples == ()
    assert child.lemmas == ("child", "kid")
    assert child.definition == "a young person of either sex"
    assert child.examples == ("she writes books for children", "they're just kids")
    (able,) = read_synsets(fake_wordnet, "adj")
    assert able.lemmas == ("able",)  # the "(p)" position marker is dropped


def test_pairs_use_synsets_with_examples_and_the_lemma_the_example_uses(fake_wordnet):
    rows = definition_pairs(fake_wordnet)
    assert [r["id"] for r in rows] == ["noun-09917593", "adj-00011093"]
    assert rows[0] == {"id": "noun-09917593", "source": "child ( noun ) : she writes books for children",
                       "target": "a young person of either sex"}
    assert tokenize("They're here, (really)!") == "they're here , ( really ) !"


def test_a_malformed_line_names_file_and_line(tmp_path):
    (tmp_path / "data.noun").write_text("  header\n00001740 03 n zz entity | x\n")
    with pytest.raises(ValueError, match=r"data.noun:2: not a WordNet data line"):
        list(read_synsets(tmp_path, "noun"))


def test_missing_wordnet_says_how_to_install(tmp_path):
    with pytest.raises(FileNotFoundError, match="wordnet-base"):
        find_wordnet(tmp_path / "nowhere")


@pytest.mark.system_package("wordnet-base")
def test_real_wordnet_task_is_deterministic_and_split(tmp_path):
    a = write_wordnet_task(tmp_path / "a", 600, seed=3)
    b = write_wordnet_task(tmp_path / "b", 600, seed=3)
    for split in ("train", "valid", "test"):
        assert a[split].read_bytes() == b[split].read_bytes()
    rows = {s: [json.loads(x) for x in a[s].read_text().splitlines()] for s in ("train", "valid", "test")}
    assert (len(rows["train"]), len(rows["valid"]), len(rows["test"])) == (540, 30, 30)
    ids = [r["id"] for split in rows.values() for r in split]
    assert len(set(ids)) == 600
    assert all(r["target"] and r["source"] for split in rows.values() for r in split)
    with pytest.raises(ValueError, match="synsets with examples"):
        write_wordnet_task(tmp_path / "c", 10**6, seed=3)
