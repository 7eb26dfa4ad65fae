"""Tests for rlt2t.common.data: the JSONL contract, the competition CSV importer/exporter, splitting."""

from __future__ import annotations

import json
import logging

import pytest

from rlt2t.common.data import (
    DataError,
    Example,
    LoadReport,
    export_competition_csv,
    import_competition_csv,
    iter_examples,
    load_examples,
    split_examples,
    write_examples,
)

GOOD_1 = '{"id": 1, "source": "5 6 7", "target": "8 9", "lang": "x"}'
GOOD_2 = '{"id": "b", "source": "1 <sep> 2", "target": "3"}'


def _write(path, lines: list[str] | bytes):
    path.write_bytes(lines if isinstance(lines, bytes) else ("\n".join(lines) + "\n").encode())
    return path


def reject_big_tokens(text: str) -> str | None:
    for tok in text.split():
        if tok.isdigit() and int(tok) > 100:
            return f"token '{tok}' is outside the vocabulary (0..100)"
    return None


def test_load_happy_path(tmp_path):
    path = _write(tmp_path / "d.jsonl", [GOOD_1, "", GOOD_2])
    examples = load_examples(path)
    assert examples == [
        Example(id="1", source="5 6 7", target="8 9", extra={"lang": "x"}),
        Example(id="b", source="1 <sep> 2", target="3"),
    ]
    assert isinstance(examples, list)
    report = examples.report
    assert (report.lines, report.loaded, report.skipped, report.reasons) == (2, 2, 0, [])
    assert report.summary() == f"{path}: 2 examples"


def test_unlabeled_inputs_need_require_target_false(tmp_path):
    path = _write(
        tmp_path / "t.jsonl", ['{"id": 1, "source": "5"}', '{"id": 2, "source": "6", "target": null}']
    )
    examples = load_examples(path, require_target=False)
    assert [e.target for e in examples] == [None, None]
    with pytest.raises(DataError, match=r":1: field 'target': missing"):
        load_examples(path)


BAD_LINES = [
    ('{"id": 3, "source": "1 2"', None, "not valid JSON"),
    ("[1, 2]", None, "expected a JSON object, got list"),
    ('{"source": "1", "target": "2"}', "id", "missing"),
    ('{"id": true, "source": "1", "target": "2"}', "id", "expected a string or an integer, got bool"),
    ('{"id": 1.5, "source": "1", "target": "2"}', "id", "expected a string or an integer, got float"),
    ('{"id": " ", "source": "1", "target": "2"}', "id", "empty"),
    ('{"id": 1, "source": "9", "target": "2"}', "id", "duplicate id '1' (first on line 1)"),
    ('{"id": 3, "target": "2"}', "source", "missing"),
    ('{"id": 3, "source": 17, "target": "2"}', "source", "expected a string, got int"),
    ('{"id": 3, "source": "  ", "target": "2"}', "source", "empty"),
    ('{"id": 3, "source": "1"}', "target", "missing"),
    ('{"id": 3, "source": "1", "target": ["2"]}', "target", "expected a string, got list"),
    ('{"id": 3, "source": "1", "target": ""}', "target", "empty"),
    (
        '{"id": 3, "source": "1 999", "target": "2"}',
        "source",
        "token '999' is outside the vocabulary (0..100)",
    ),
    (
        '{"id": 3, "source": "1", "target": "2 500"}',
        "target",
        "token '500' is outside the vocabulary (0..100)",
    ),
]


@pytest.mark.parametrize(
    ("line", "field", "reason"), BAD_LINES, ids=[f"{f}:{r[:20]}" for _, f, r in BAD_LINES]
)
def test_bad_line_names_file_line_and_field(tmp_path, line, field, reason):
    # A blank line 3 checks that the reported line number is the physical line, not the row index.
    path = _write(tmp_path / "bad.jsonl", [GOOD_1, GOOD_2, "", line])
    with pytest.raises(DataError) as info:
        load_examples(path, check_text=reject_big_tokens)
    where = f"field '{field}': " if field else ""
    assert str(info.value).startswith(f"{path}:4: {where}{reason}")
    assert (info.value.line, info.value.field) == (4, field)
    assert isinstance(info.value, ValueError)


def test_invalid_utf8_is_a_data_error(tmp_path):
    path = _write(tmp_path / "bin.jsonl", (GOOD_1 + "\n").encode() + b'{"id": 2, "source": "\xff"}\n')
    with pytest.raises(DataError, match=r"bin\.jsonl:2: not valid UTF-8"):
        load_examples(path)


def test_skip_counts_and_logs(tmp_path, caplog):
    lines = [GOOD_1, '{"id": 2, "source": ""}', GOOD_2, "not json", '{"id": 5, "source": "7", "target": "8"}']
    path = _write(tmp_path / "mixed.jsonl", lines)
    with caplog.at_level(logging.WARNING, logger="rlt2t.data"):
        examples = load_examples(path, on_error="skip")
    assert [e.id for e in examples] == ["1", "b", "5"]
    report = examples.report
    assert (report.lines, report.loaded, report.skipped) == (5, 3, 2)
    assert report.reasons == [
        f"{path}:2: field 'source': empty",
        f"{path}:4: not valid JSON (Expecting value, column 1)",
    ]
    assert "2 bad line(s) skipped" in report.summary()
    records = [r for r in caplog.records if r.name == "rlt2t.data"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert "skipped 2 of 5" in records[0].getMessage()
    assert f"{path}:2: field 'source': empty" in records[0].getMessage()


def test_skip_keeps_only_the_first_few_reasons(tmp_path):
    path = _write(tmp_path / "many.jsonl", [GOOD_1] + ["{"] * 20)
    report = load_examples(path, on_error="skip").report
    assert report.skipped == 20 and len(report.reasons) == 5


def test_clean_load_logs_nothing(tmp_path, caplog):
    path = _write(tmp_path / "d.jsonl", [GOOD_1, GOOD_2])
    with caplog.at_level(logging.DEBUG, logger="rlt2t.data"):
        load_examples(path, on_error="skip")
    assert not [r for r in caplog.records if r.name == "rlt2t.data"]


def test_iter_examples_streams_and_fills_report(tmp_path):
    path = _write(tmp_path / "d.jsonl", [GOOD_1, "{", GOOD_2])
    report = LoadReport(str(path))
    stream = iter_examples(path, on_error="skip", report=report)
    assert next(stream).id == "1"
    assert report.loaded == 1  # lazily read: the rest is not parsed yet
    assert [e.id for e in stream] == ["b"]
    assert (report.loaded, report.skipped) == (2, 1)


def test_on_error_is_validated(tmp_path):
    path = _write(tmp_path / "d.jsonl", [GOOD_1])
    with pytest.raises(ValueError, match="on_error"):
        load_examples(path, on_error="ignore")
    with pytest.raises(ValueError, match="on_error"):
        iter_examples(path, on_error="ignore")  # at the call, before any iteration
    with pytest.raises(ValueError, match="on_error"):
        import_competition_csv(path, on_error="warn")


def test_write_load_round_trip(tmp_path):
    examples = [
        Example(id="a", source="1 2 3", target="4", extra={"weight": 0.5, "tags": ["x"]}),
        Example(id="7", source="<sep> 9", target=None),
    ]
    path = tmp_path / "sub" / "out.jsonl"
    assert write_examples(path, examples) == 2
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows[1] == {"id": "7", "source": "<sep> 9"}  # a None target is left out, not written as null
    assert load_examples(path, require_target=False) == examples


def test_write_rejects_duplicates_without_leaving_a_file(tmp_path):
    path = tmp_path / "dup.jsonl"
    with pytest.raises(ValueError, match=r"examples\[1\]: duplicate id 'a'"):
        write_examples(path, [Example("a", "1", "2"), Example("a", "3", "4")])
    assert not path.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"id": "", "source": "1", "target": None}, "Example.id"),
        ({"id": 3, "source": "1", "target": None}, "Example.id"),
        ({"id": "a", "source": " ", "target": None}, "Example.source"),
        ({"id": "a", "source": "1", "target": 5}, "Example.target"),
        ({"id": "a", "source": "1", "target": "2", "extra": {"target": "x"}}, "reserved"),
    ],
)
def test_example_validates_its_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Example(**kwargs)


# ---------------------------------------------------------------------------------------------
# Competition CSV
# ---------------------------------------------------------------------------------------------


def test_import_four_columns(tmp_path):
    path = _write(tmp_path / "train.csv", ["1, 5  6 7 ,8 9,10 11", "2,5,8,", "", '3,"4 4",,12'])
    examples = import_competition_csv(path)
    assert examples == [
        Example(id="1", source="10 11 <sep> 5 6 7", target="8 9"),
        Example(id="2", source="<sep> 5", target="8"),  # empty clinical keeps the separator
        Example(id="3", source="12 <sep> 4 4", target=None),  # empty diagnosis: unlabeled
    ]
    assert examples.report.loaded == 3


def test_import_three_and_two_columns(tmp_path):
    three = import_competition_csv(_write(tmp_path / "a.csv", ["7,1 2,3", "8,4,"]), separator_token="[SEP]")
    assert three == [Example("7", "1 2", "3"), Example("8", "4", None)]
    two = import_competition_csv(_write(tmp_path / "b.csv", ["7,1 2", "8,4"]))
    assert two == [Example("7", "1 2", None), Example("8", "4", None)]


BAD_ROWS = [
    (
        "3,1 2,3",
        None,
        "expected 4 columns (report_id, description, diagnosis, clinical) like the first row, got 3",
    ),
    ("3,1 2,3,4,5", None, "expected 4 columns"),
    ("3,1 x2,3,4", "description", "token 'x2' is not a non-negative integer"),
    ("3,1 2,-3,4", "diagnosis", "token '-3' is not a non-negative integer"),
    ("3,1 2,3,4.0", "clinical", "token '4.0' is not a non-negative integer"),
    ("3, ,3,4", "description", "empty"),
    (",1,3,4", "report_id", "empty"),
    ("1,1,3,4", "report_id", "duplicate id '1' (first on line 1)"),
    ("3,1 2 200,3,4", "description", "token '200' is outside the vocabulary (0..100)"),
]


@pytest.mark.parametrize(("row", "field", "reason"), BAD_ROWS, ids=[f"{f}:{r[:20]}" for _, f, r in BAD_ROWS])
def test_import_bad_row_names_file_line_and_field(tmp_path, row, field, reason):
    path = _write(tmp_path / "bad.csv", ["1,5 6,7,", "2,5,7,1", row])
    with pytest.raises(DataError) as info:
        import_competition_csv(path, check_text=reject_big_tokens)
    where = f"field '{field}': " if field else ""
    assert str(info.value).startswith(f"{path}:3: {where}{reason}")


def test_import_first_row_with_bad_width(tmp_path):
    with pytest.raises(DataError, match=r"one\.csv:1: expected 2 to 4 columns"):
        import_competition_csv(_write(tmp_path / "one.csv", ["1 2 3"]))


def test_import_skip_counts_and_logs(tmp_path, caplog):
    path = _write(tmp_path / "mixed.csv", ["1,5 6,7", "2,5,7,9", "3,a,7", "4,8,9"])
    with caplog.at_level(logging.WARNING, logger="rlt2t.data"):
        examples = import_competition_csv(path, on_error="skip")
    assert [e.id for e in examples] == ["1", "4"]
    assert (examples.report.loaded, examples.report.skipped) == (2, 2)
    message = " ".join(r.getMessage() for r in caplog.records if r.name == "rlt2t.data")
    assert "skipped 2 of 4" in message and f"{path}:3: field 'description'" in message


def test_a_labelled_import_needs_a_diagnosis_on_every_row(tmp_path):
    # An empty diagnosis made target=None; the later error named a Python argument, not the CLI's --unlabeled.
    path = _write(tmp_path / "train.csv", ["1,5 6,7", "2,5 6,", "3,5 6, ", "4,8,9"])
    assert [e.target for e in import_competition_csv(path)] == ["7", None, None, "9"]  # unlabelled: allowed
    with pytest.raises(DataError, match=r"train\.csv:2: field 'diagnosis': empty .*--unlabeled"):
        import_competition_csv(path, require_target=True)
    loaded = import_competition_csv(path, require_target=True, on_error="skip")
    assert [e.id for e in loaded] == ["1", "4"] and loaded.report.skipped == 2
    two = _write(tmp_path / "two.csv", ["1,5 6"])
    with pytest.raises(DataError, match=r"two\.csv:1: field 'diagnosis': missing"):
        import_competition_csv(two, require_target=True)


def test_a_missing_target_names_the_command_lines_flag(tmp_path):
    path = _write(tmp_path / "test.jsonl", ['{"id": "1", "source": "5 6"}'])
    with pytest.raises(DataError, match=r"test\.jsonl:1: field 'target': missing .*read with --unlabeled \(data "
                                        r"import, data validate; require_target=False in Python\); SFT and "
                                        r"evaluation need a target on every row, RL where its reward or algorithm "
                                        r"reads them"):
        load_examples(path)


def test_export_is_headerless_and_normalised(tmp_path):
    path = tmp_path / "sub.csv"
    assert export_competition_csv(path, [10, "11", 12], ["1 2", " 3\n4 ", ""]) == 3
    assert path.read_text() == "10,1 2\n11,3 4\n12,\n"


@pytest.mark.parametrize(
    ("ids", "preds", "match"),
    [
        ([1, 2], ["1"], "same length"),
        ([1, 1], ["1", "2"], r"ids\[1\]: duplicate"),
        ([" "], ["1"], "empty"),
        ([1], [3], r"predictions\[0\] must be a string"),
    ],
)
def test_export_rejects_bad_input(tmp_path, ids, preds, match):
    path = tmp_path / "sub.csv"
    with pytest.raises(ValueError, match=match):
        export_competition_csv(path, ids, preds)
    assert not path.exists()


# ---------------------------------------------------------------------------------------------
# Splitting
# ---------------------------------------------------------------------------------------------


def test_split_is_deterministic_disjoint_and_ordered():
    items = list(range(1000))
    train, valid, test = split_examples(items, 0.1, 0.05, seed=3)
    assert (len(train), len(valid), len(test)) == (850, 100, 50)
    assert sorted(train + valid + test) == items
    assert all(part == sorted(part) for part in (train, valid, test))
    assert split_examples(items, 0.1, 0.05, seed=3) == (train, valid, test)
    assert split_examples(items, 0.1, 0.05, seed=4)[1] != valid


def test_split_tiny_inputs_get_one_row_per_split():
    assert [len(p) for p in split_examples(["a", "b", "c"], 0.01, 0.01, seed=0)] == [1, 1, 1]
    assert [len(p) for p in split_examples(["a", "b"], 0.0, 0.3, seed=0)] == [1, 0, 1]


@pytest.mark.parametrize(
    ("n", "valid", "test", "match"),
    [
        (10, -0.1, 0.1, "valid_fraction"),
        (10, 0.1, 1.0, "test_fraction"),
        (10, 0.6, 0.4, r"valid_fraction \+ test"),
        (2, 0.1, 0.1, "too few"),
    ],
)
def test_split_validates_arguments(n, valid, test, match):
    with pytest.raises(ValueError, match=match):
        split_examples(list(range(n)), valid, test, seed=0)


@pytest.mark.parametrize("size", [1, 2])
def test_a_sampled_task_too_small_for_its_splits_is_refused(tmp_path, size):
    """The docstring and WordNet tasks draw `size` rows: train must keep one after valid and test."""
    from rlt2t.common.data import write_sampled_task

    rows = [{"id": str(i), "source": f"s{i}", "target": f"t{i}"} for i in range(10)]
    with pytest.raises(ValueError, match=f"size: {size} item\\(s\\) are too few for a train split"):
        write_sampled_task(tmp_path, rows, size, 7, 0.05, 0.05, "meta.json", {})
    assert not list(tmp_path.iterdir())
    paths = write_sampled_task(tmp_path, rows, 3, 7, 0.05, 0.05, "meta.json", {})
    assert [len(paths[k].read_text().splitlines()) for k in ("train", "valid", "test")] == [1, 1, 1]


@pytest.mark.parametrize(("line", "match"), [
    ('{"id": ' + "9" * 5000 + ', "source": "1", "target": "2"}', r":1: not valid JSON here \(ValueError"),
    ('{"id": "a", "source": ' + "[" * 100000 + "]" * 100000 + ', "target": "2"}',
     r":1: not valid JSON here \(RecursionError"),
])
def test_json_the_parser_refuses_is_named_with_its_line(tmp_path, line, match):
    from rlt2t.common.data import DataError, load_examples

    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(DataError, match=match):
        load_examples(path)


def test_a_csv_field_over_the_csv_modules_limit_is_named_with_its_line(tmp_path):
    from rlt2t.common.data import DataError, import_competition_csv

    path = tmp_path / "big.csv"
    path.write_text("1,2\n3," + "4 " * 80000 + "\n")
    with pytest.raises(DataError, match=r"big.csv:2: not readable as CSV \(field larger than field limit"):
        import_competition_csv(path)


def test_a_jsonl_file_without_ids_numbers_its_rows_and_names_what_a_row_lacks(tmp_path):
    # Most people's data is {"source": ..., "target": ...} a line: numbered as a CSV without an id column is.
    path = _write(tmp_path / "plain.jsonl", ['{"source": "1 2", "target": "3"}', "",
                                            '{"source": "4", "target": "5", "topic": "x"}'])
    examples = load_examples(path)
    assert [(e.id, e.source, e.extra) for e in examples] == [("1", "1 2", {}), ("2", "4", {"topic": "x"})]
    mixed = _write(tmp_path / "mixed.jsonl", ['{"source": "1", "target": "3"}', '{"id": 9, "source": "4", '
                                                                               '"target": "5"}'])
    with pytest.raises(DataError, match=r"mixed\.jsonl:2: field 'id': present, but the file's first row has none"):
        load_examples(mixed)
    # A field the config does not name: the error lists the row's fields and the key that maps them.
    renamed = _write(tmp_path / "renamed.jsonl", ['{"id": 1, "document": "1 2", "summary": "3"}'])
    with pytest.raises(DataError, match=r"field 'source': missing \(data\.source_field names the field that holds "
                                        r"the source; this row's other fields: 'document', 'summary'\)"):
        load_examples(renamed)
    with pytest.raises(DataError, match=r"field 'target': missing \(data\.target_field or data\.references_field.*"
                                        r"other fields: 'sumary'"):
        load_examples(_write(tmp_path / "typo.jsonl", ['{"id": 1, "source": "1 2", "sumary": "3"}']))
