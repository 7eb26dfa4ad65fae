"""The docstring-summary task: names split into words, summaries cut to their first sentence, boilerplate and
over-shared summaries left out, the rows deterministic; on a package written by the test."""

from __future__ import annotations

import json
import logging

import pytest

from rlt2t.common.docstrings import docstring_pairs, first_sentence, split_name, write_docstring_task

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
