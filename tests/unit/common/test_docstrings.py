"""The docstring-summary task: names split into words, summaries cut to their first sentence, boilerplate and
over-shared summaries left out, the rows deterministic; on a package written by the test."""

from __future__ import annotations

import json
import logging

import pytest

from rlt2t.common.data import load_examples, reference_sets
from rlt2t.common.docstrings import (
    docstring_pairs,
    first_sentence,
    name_of,
    package_dirs,
    split_name,
    write_docstring_names_task,
    write_docstring_task,
)

MODULE = '''
def compute_num_maskedSpan(input_length, *, min_masks=0):
    """Given input length, compute how many spans should be masked. More text follows.

    Details.
    """

def _private(x):
    """Never used: a private function."""

def stub(x):
    """Missing associated documentation comment in .proto file."""

def short(x):
    """Too short."""

class Thing:
    def grow(self, factor):
        """Grow the thing by a factor and return it."""
'''


@pytest.fixture()
def package(tmp_path):
    root = tmp_path / "fakepkg"
    (root / "tests").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "core.py").write_text(MODULE)
    (root / "tests" / "test_core.py").write_text(MODULE)  # tests are left out
    for i in range(5):  # one summary shared by five functions: too generic to keep
        (root / f"shared{i}.py").write_text(f'def f{i}(a):\n    """Return the value of the thing."""\n')
    return root


def test_names_and_summaries():
    assert split_name("compute_num_maskedSpan") == "compute num masked span"
    assert split_name("HTTPServer2") == "http server 2"
    assert first_sentence("Given x, do y. More text.\n\nDetails.") == "Given x, do y."


def test_pairs_keep_public_documented_functions_and_drop_boilerplate(package):
    rows = docstring_pairs([package])
    assert [(r["source"], r["target"]) for r in rows] == [
        ("fakepkg core : compute num masked span ( input length , min masks )",
         "given input length , compute how many spans should be masked ."),
        ("fakepkg core : grow ( factor )", "grow the thing by a factor and return it ."),
    ]
    assert rows[0]["id"] == "fakepkg/core.py:compute_num_maskedSpan:0"


def test_reading_the_packages_says_how_far_it_got(package, tmp_path, caplog):
    # `rlt2t data docstrings` reads every installed package for minutes: one line per package, with the count.
    other = tmp_path / "otherpkg"
    other.mkdir()
    (other / "mod.py").write_text(MODULE)
    with caplog.at_level(logging.INFO, logger="rlt2t.docstrings"):
        docstring_pairs([package, other])
    lines = [r.getMessage() for r in caplog.records if r.name == "rlt2t.docstrings"]
    assert lines[0].startswith("docstrings: reading fakepkg (1 of 2 packages, ")
    assert lines[0].endswith("; 0 pairs so far")
    assert lines[1] == "docstrings: reading otherpkg (2 of 2 packages, 1 files); 7 pairs so far"
    assert lines[2].startswith("docstrings: 9 pairs from 2 packages")


def test_the_task_files_are_deterministic_and_split(tmp_path):
    a = write_docstring_task(tmp_path / "a", 300, seed=3, packages=("yaml", "jinja2", "rich", "pydantic"))
    b = write_docstring_task(tmp_path / "b", 300, seed=3, packages=("yaml", "jinja2", "rich", "pydantic"))
    for split in ("train", "valid", "test"):
        assert a[split].read_bytes() == b[split].read_bytes()
    meta = json.loads(a["meta"].read_text())
    assert (meta["train_rows"], meta["valid_rows"], meta["test_rows"]) == (270, 15, 15)
    assert set(meta["packages"]) <= {"yaml", "jinja2", "rich", "pydantic"} and meta["available"] >= 300
    with pytest.raises(ValueError, match="documented functions"):
        write_docstring_task(tmp_path / "c", 10**7, seed=3, packages=("yaml",))
    with pytest.raises(FileNotFoundError, match="installed"):
        write_docstring_task(tmp_path / "d", 10, seed=3, packages=("no_such_package_xyz",))


SMALL = ("yaml", "jinja2", "rich", "pydantic")


def test_the_names_task_has_every_summary_of_a_name_as_its_references(tmp_path):
    a = write_docstring_names_task(tmp_path / "a", seed=3, max_references=4, packages=SMALL)
    b = write_docstring_names_task(tmp_path / "b", seed=3, max_references=4, packages=SMALL)
    for split in ("train", "valid", "test"):
        assert a[split].read_bytes() == b[split].read_bytes()
    summaries: dict[str, set[str]] = {}
    for row in docstring_pairs(package_dirs(SMALL)):
        summaries.setdefault(name_of(row["source"]), set()).add(row["target"])
    splits = {split: list(load_examples(a[split])) for split in ("train", "valid", "test")}
    sources = {split: {e.source for e in rows} for split, rows in splits.items()}
    assert not sources["train"] & sources["valid"] and not sources["train"] & sources["test"]
    assert not sources["valid"] & sources["test"]
    for split, rows in splits.items():
        for e in rows:
            assert 2 <= len(set(e.references)) == len(e.references) <= 4
            assert set(e.references) <= summaries[e.source]
            assert len(e.references) == min(4, len(summaries[e.source]))
            if split != "train":
                assert e.target == e.references[0]
    # Train: one row per reference, each naming all of them; CIDEr-D counts each name once.
    by_source: dict[str, list] = {}
    for e in splits["train"]:
        by_source.setdefault(e.source, []).append(e)
    for rows in by_source.values():
        assert [e.target for e in rows] == list(rows[0].references)
        assert all(e.references == rows[0].references for e in rows)
    assert len(reference_sets(splits["train"])) == len(by_source)
    meta = json.loads(a["meta"].read_text())
    assert (meta["train_sources"], meta["train_rows"]) == (len(by_source), len(splits["train"]))
    assert meta["valid_sources"] == len(splits["valid"]) >= 1 and meta["test_sources"] == len(splits["test"]) >= 1


def test_the_names_task_refuses_bad_reference_bounds(tmp_path):
    with pytest.raises(ValueError, match="min_references <= max_references"):
        write_docstring_names_task(tmp_path, seed=3, min_references=5, max_references=2, packages=SMALL)
