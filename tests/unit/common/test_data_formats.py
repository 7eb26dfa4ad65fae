"""CSV with a header, Parquet and Hugging Face datasets files (rlt2t.common.data_formats): each loads to the
examples of the same rows in JSONL, under the file's own column names, with JSONL's file:row: field errors, and
Parquet/datasets are read in batches and served from Arrow."""

from __future__ import annotations

import csv
import json
import logging
import pickle
import tracemalloc
from typing import get_args

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlt2t.common.config import DataConfig, load_config
from rlt2t.common.data import (
    ArrowExamples,
    Columns,
    DataError,
    Example,
    LoadedExamples,
    LoadReport,
    iter_examples,
    load_examples,
)
from rlt2t.common.data_formats import FORMATS, detect_format

MAPPED = Columns(id="doc_id", source="document", target="summary", references="refs")
ROWS = [
    {"doc_id": "a", "document": "5 6 7", "summary": "8 9", "lang": "en"},
    {"doc_id": "b", "document": "1 2", "summary": "3", "lang": "fr"},
    {"doc_id": "c", "document": "4", "summary": "2 2", "refs": ["2 2", "2 3"], "lang": "en"},
]


def _columns(rows: list[dict]) -> dict[str, list]:
    names = list(dict.fromkeys(k for r in rows for k in r))
    return {n: [r.get(n) for r in rows] for n in names}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_csv(path, rows, delimiter=","):
    names = list(_columns(rows))
    with open(path, "w", newline="") as f:
        w = csv.writer(f, delimiter=delimiter)
        w.writerow(names)
        for r in rows:
            w.writerow([json.dumps(r[n]) if isinstance(r.get(n), list) else r.get(n, "") for n in names])
    return path


def write_parquet(path, rows, **options):
    pq.write_table(pa.table(_columns(rows)), path, **options)
    return path


def write_dataset(path, rows):
    datasets.Dataset.from_dict(_columns(rows)).save_to_disk(str(path))
    return path


def write_arrow(path, rows):
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, (t := pa.table(_columns(rows))).schema) as w:
        w.write_table(t)
    return path


WRITERS = {
    "data.csv": write_csv,
    "data.tsv": lambda p, rows: write_csv(p, rows, delimiter="\t"),
    "data.parquet": write_parquet,
    "saved_dataset": write_dataset,
    "data.arrow": write_arrow,
}


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    # data.format=datasets on a file converts it into datasets' cache: keep that cache in the test's directory.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


@pytest.mark.parametrize("name", list(WRITERS))
def test_each_format_loads_the_examples_of_the_same_rows_in_jsonl(tmp_path, name):
    expected = list(load_examples(write_jsonl(tmp_path / "data.jsonl", ROWS), columns=MAPPED))
    assert expected[2] == Example("c", "4", "2 2", {"lang": "en"}, ("2 2", "2 3"))
    loaded = load_examples(WRITERS[name](tmp_path / name, ROWS), columns=MAPPED)
    assert list(loaded) == expected
    assert list(iter_examples(tmp_path / name, columns=MAPPED)) == expected
    assert loaded.report.loaded == 3 and loaded.report.skipped == 0


@pytest.mark.parametrize("name", ["data.jsonl", "data.csv", "data.parquet"])
def test_local_files_load_through_datasets(tmp_path, name):
    writer = {"data.jsonl": write_jsonl, "data.csv": write_csv, "data.parquet": write_parquet}[name]
    rows = [{k: v for k, v in r.items() if k != "refs"} for r in ROWS]  # pandas reads a CSV list cell as text
    path = writer(tmp_path / name, rows)
    loaded = load_examples(path, fmt="datasets", columns=MAPPED)
    assert isinstance(loaded, ArrowExamples)
    assert list(loaded) == list(load_examples(write_jsonl(tmp_path / "same.jsonl", rows), columns=MAPPED))


def test_the_format_is_told_by_the_path_unless_given(tmp_path):
    (tmp_path / "saved").mkdir()
    cases = {"a.jsonl": "jsonl", "a.txt": "jsonl", "a.CSV": "csv", "a.tsv": "csv", "a.parquet": "parquet",
             "a.pq": "parquet", "a.arrow": "datasets", "saved": "datasets"}
    assert {name: detect_format(tmp_path / name) for name in cases} == cases
    assert detect_format(tmp_path / "a.txt", "csv") == "csv"
    with pytest.raises(ValueError, match="must be one of auto, jsonl, csv, parquet, datasets, got 'xml'"):
        detect_format("a.xml", "xml")
    assert set(get_args(DataConfig.model_fields["format"].annotation)) == set(FORMATS)


def test_a_txt_file_is_read_as_csv_when_the_format_says_so(tmp_path):
    path = write_csv(tmp_path / "rows.txt", ROWS)
    assert [e.id for e in load_examples(path, fmt="csv", columns=MAPPED)] == ["a", "b", "c"]


@pytest.mark.parametrize("name", ["data.csv", "data.parquet", "saved_dataset"])
def test_a_file_without_the_id_column_numbers_its_rows(tmp_path, name):
    rows = [{k: v for k, v in r.items() if k != "doc_id"} for r in ROWS]
    loaded = load_examples(WRITERS[name](tmp_path / name, rows), columns=MAPPED)
    assert [e.id for e in loaded] == ["1", "2", "3"]
    assert [e.id for e in loaded[1:]] == ["2", "3"]


def test_jsonl_rows_are_numbered_without_the_id_field_and_all_named_with_it(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"document": "1", "summary": "2"}, {"document": "3", "summary": "4"}])
    assert [e.id for e in load_examples(path, columns=MAPPED)] == ["1", "2"]
    path = write_jsonl(tmp_path / "e.jsonl", [{"doc_id": "a", "document": "1", "summary": "2"},
                                              {"document": "3", "summary": "4"}])
    with pytest.raises(DataError, match=r"e\.jsonl:2: field 'doc_id': missing \(the file's first row has one"):
        load_examples(path, columns=MAPPED)


# --- bad rows ---------------------------------------------------------------------------------------------

BAD = [
    ({"doc_id": "x", "document": "  ", "summary": "1"}, "document", "empty"),
    ({"doc_id": "a", "document": "9", "summary": "1"}, "doc_id", "duplicate id 'a' (first on {unit} {first})"),
    ({"doc_id": "x", "document": "9", "summary": None}, "summary", "missing (a file without targets"),
    ({"doc_id": "x", "document": "9", "summary": "1", "refs": ["2", " "]}, "refs[1]", "empty"),
    ({"doc_id": "x", "document": "9", "summary": "1", "refs": ["2"]}, "summary", "not one of the row's references"),
]


@pytest.mark.parametrize("name", ["data.csv", "data.parquet", "saved_dataset"])
@pytest.mark.parametrize(("row", "field", "reason"), BAD, ids=[f for _, f, _ in BAD])
def test_a_bad_row_names_file_row_and_mapped_field(tmp_path, name, row, field, reason):
    path = WRITERS[name](tmp_path / name, [*ROWS[:2], row, ROWS[2]])
    line, unit, first = (4, "line", 2) if name == "data.csv" else (3, "row", 1)  # a CSV's header is line 1
    with pytest.raises(DataError) as info:
        load_examples(path, columns=MAPPED)
    assert str(info.value).startswith(f"{path}:{line}: field '{field}': {reason.format(unit=unit, first=first)}")
    assert (info.value.line, info.value.field) == (line, field)

    kept = load_examples(path, columns=MAPPED, on_error="skip")
    assert [e.id for e in kept] == ["a", "b", "c"]
    assert (kept.report.lines, kept.report.loaded, kept.report.skipped) == (4, 3, 1)
    assert kept.report.summary().endswith(f"3 examples, 1 bad {unit}(s) skipped")
    assert list(iter_examples(path, columns=MAPPED, on_error="skip")) == list(kept)


def test_skipped_rows_are_logged_and_left_out_of_the_arrow_sequence(tmp_path, caplog):
    rows = [{"doc_id": str(i), "document": "" if i % 3 == 0 else f"{i}", "summary": "1"} for i in range(10)]
    path = write_parquet(tmp_path / "d.parquet", rows)
    with caplog.at_level(logging.WARNING, logger="rlt2t.data"):
        loaded = load_examples(path, columns=MAPPED, on_error="skip")
    assert [e.id for e in loaded] == ["1", "2", "4", "5", "7", "8"]
    assert [e.id for e in loaded[1::2]] == ["2", "5", "8"] and loaded[-1].id == "8"
    assert "skipped 4 of 10 row(s)" in caplog.text and f"{path}:1: field 'document': empty" in caplog.text


def test_the_text_check_is_applied_to_the_mapped_fields(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", ROWS)

    def no_twos(text):
        return "has a 2" if "2" in text.split() else None

    with pytest.raises(DataError, match=r"d\.parquet:2: field 'document': has a 2"):
        load_examples(path, columns=MAPPED, check_text=no_twos)


@pytest.mark.parametrize("name", ["data.csv", "data.parquet", "saved_dataset"])
def test_columns_that_cannot_give_examples_fail_the_whole_file(tmp_path, name):
    path = WRITERS[name](tmp_path / name, [{"doc_id": "1", "text": "2", "summary": "3"}])
    with pytest.raises(ValueError, match=r"no column 'document' \(data.source_field\) among its columns: doc_id, text"):
        load_examples(path, columns=MAPPED, on_error="skip")
    path = WRITERS[name](tmp_path / f"2{name}", [{"doc_id": "1", "document": "2"}])
    with pytest.raises(ValueError, match=r"no column 'summary' \(data.target_field\) or 'refs'"):
        load_examples(path, columns=MAPPED)
    assert [e.target for e in load_examples(path, columns=MAPPED, require_target=False)] == [None]
    path = WRITERS[name](tmp_path / f"3{name}", [{"doc_id": "1", "document": "2", "summary": "3", "source": "4"}])
    with pytest.raises(ValueError, match=r"column 'source' has a name rlt2t keeps .* the column 'document' here"):
        load_examples(path, columns=MAPPED)


def test_csv_cells(tmp_path):
    path = tmp_path / "d.csv"
    path.write_bytes(b"doc_id,document,summary,refs,note\n"
                     b"1,5 6,,,\n"  # an empty summary: no target
                     b"2,5,7,not json,\n"
                     b"3,5,7\n"
                     b"4,5 \xff,7,,\n"
                     b'5,"a ""quoted"",\nmultiline text",7,"[""7"", ""8""]",x\n')
    kept = load_examples(path, columns=MAPPED, on_error="skip", require_target=False)
    assert kept == [Example("1", "5 6", None, {"note": ""}),
                    Example("5", 'a "quoted",\nmultiline text', "7", {"note": "x"}, ("7", "8"))]
    assert kept.report.reasons == [
        f"{path}:3: field 'refs': expected a JSON list of strings in the cell, e.g. [\"first reference\", \"second\"]",
        f"{path}:4: expected 5 columns like the header, got 3",
        f"{path}:5: not valid UTF-8 (invalid start byte at byte 4)",
    ]


def test_csv_header_names_must_be_distinct(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("document,summary,document\n1,2,3\n")
    with pytest.raises(ValueError, match="column.s. document appear more than once"):
        load_examples(path, columns=MAPPED)


def test_datasets_paths_that_are_not_one_split_are_refused(tmp_path):
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict(_columns(ROWS)),
                               "validation": datasets.Dataset.from_dict(_columns(ROWS))})
    dd.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"a DatasetDict directory \(splits: train, validation\): point data.train"):
        load_examples(tmp_path / "dd", columns=MAPPED)
    assert [e.id for e in load_examples(tmp_path / "dd" / "validation", columns=MAPPED)] == ["a", "b", "c"]
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="a directory, but not one Hugging Face datasets saved"):
        load_examples(tmp_path / "plain")
    with pytest.raises(FileNotFoundError):
        load_examples(tmp_path / "gone.parquet")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match=r"bad\.parquet: not readable as Parquet"):
        load_examples(tmp_path / "bad.parquet")


# --- Arrow-backed loads and streaming ---------------------------------------------------------------------

def test_a_datasets_directory_round_trips_through_arrow_examples(tmp_path):
    path = write_dataset(tmp_path / "saved", ROWS)
    loaded = load_examples(path, columns=MAPPED)
    assert isinstance(loaded, ArrowExamples) and len(loaded) == 3
    assert loaded[0] == Example("a", "5 6 7", "8 9", {"lang": "en"}) and loaded[-1].references == ("2 2", "2 3")
    assert [e.id for e in loaded[::-1]] == ["c", "b", "a"] and isinstance(loaded[:2], ArrowExamples)
    with pytest.raises(IndexError):
        loaded[3]
    again = pickle.loads(pickle.dumps(loaded[1:]))  # what a Ray worker receives: the view's rows, as a list
    assert isinstance(again, LoadedExamples) and list(again) == list(loaded[1:]) and again.report.loaded == 3
    write_dataset(tmp_path / "back", [e.to_dict() for e in loaded])
    assert list(load_examples(tmp_path / "back")) == list(loaded)  # rlt2t's own names: no mapping needed


def _many_rows(n: int) -> pa.Table:
    text = " ".join(str(i % 97) for i in range(40))  # ~110 characters
    return pa.table({"id": [f"row-{i}" for i in range(n)], "source": [f"{i} {text}" for i in range(n)],
                     "target": [f"{text} {i}" for i in range(n)]})


def _python_peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_parquet_file_is_streamed_in_batches_and_loaded_without_a_python_object_per_row(tmp_path):
    n = 40_000  # as Examples, some 25 MB of Python objects; as a stream, a batch of them at a time
    path = tmp_path / "big.parquet"
    pq.write_table(_many_rows(n), path, row_group_size=10_000)
    stream = iter_examples(path)
    assert iter(stream) is stream  # a generator, not a list
    report = LoadReport(str(path))
    streamed = _python_peak(lambda: sum(1 for _ in iter_examples(path, report=report)))
    assert report.loaded == n
    materialised = _python_peak(lambda: list(iter_examples(path)))
    assert streamed < materialised / 4 and streamed < 8 * 2**20, (streamed, materialised)

    tracemalloc.start()
    try:
        loaded = load_examples(path)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert isinstance(loaded, ArrowExamples) and len(loaded) == n
    assert held < 2 * 2**20, held  # the rows live in the Arrow table, not in Python objects
    assert loaded[12_345].id == "row-12345" and sum(1 for _ in loaded[:25_000]) == 25_000


def test_duplicates_are_found_across_batches_without_remembering_every_id(tmp_path):
    table = _many_rows(10_000)
    ids = table.column("id").to_pylist()
    ids[9_000] = ids[17]
    table = table.set_column(0, "id", pa.array(ids))
    path = tmp_path / "dup.parquet"
    pq.write_table(table, path, row_group_size=2_000)
    with pytest.raises(DataError, match=r"dup\.parquet:9001: field 'id': duplicate id 'row-17' \(first on row 18\)"):
        list(iter_examples(path))
    assert len(load_examples(path, on_error="skip")) == 9_999


def test_the_config_maps_columns_and_refuses_one_field_for_two_parts(tmp_path):
    cfg = load_config(overrides=["data.source_field=document", "data.target_field=summary", "data.id_field=doc_id",
                                 "data.references_field=refs", "data.format=parquet"])
    assert Columns.of(cfg.data) == MAPPED
    with pytest.raises(ValueError, match="must name different fields"):
        load_config(overrides=["data.source_field=target"])


# --- the command line -------------------------------------------------------------------------------------

MAPPING = ["data.id_field=doc_id", "data.source_field=document", "data.target_field=summary",
           "data.references_field=refs"]


def test_data_validate_streams_any_format_with_the_mapping(tmp_path, cli):
    run = tmp_path / "r"
    assert cli("tokenizer", "build", f"run.dir={run}", "tokenizer.num_data_tokens=100")[0] == 0
    path = write_dataset(tmp_path / "saved", [*ROWS, {"doc_id": "d", "document": "1 200", "summary": "1"}])
    code, _, err = cli("data", "validate", "--files", str(path), f"run.dir={run}", *MAPPING)
    assert code == 2 and f"{path}:4: field 'document': token '200'" in err
    code, out, _ = cli("data", "validate", "--files", str(path), f"run.dir={run}", "data.on_error=skip",
                       "data.max_source_len=3", *MAPPING)
    assert code == 0 and f"{path}: 3 examples, 1 bad row(s) skipped" in out
    assert "sources: 1 of 3 over data.max_source_len=3 tokens; length p50 3, p90 4, p99 4, max 4" in out
    assert "targets: 0 of 3 over data.max_target_len=64 tokens; length p50 3, p90 3, p99 3, max 3" in out


def test_data_import_writes_jsonl_from_any_format_that_the_same_settings_read(tmp_path, cli):
    """The split files keep the mapping's field names, so one config (--config my_task.yaml) serves the import
    and every command after it."""
    path = write_parquet(tmp_path / "d.parquet", [{k: v for k, v in r.items() if k != "doc_id"} for r in ROWS])
    out, run = tmp_path / "imported", f"run.dir={tmp_path / 'r'}"
    code, printed, err = cli("data", "import", "--input", str(path), "--out", str(out), "--valid-fraction", "0.3",
                             run, *MAPPING)
    assert code == 0, err
    assert "train: " in printed and "valid: " in printed
    rows = [json.loads(line) for split in ("train", "valid") for line in (out / f"{split}.jsonl").open()]
    assert sorted(rows, key=lambda r: r["doc_id"]) == [
        {"doc_id": "1", "document": "5 6 7", "summary": "8 9", "lang": "en"},
        {"doc_id": "2", "document": "1 2", "summary": "3", "lang": "fr"},
        {"doc_id": "3", "document": "4", "summary": "2 2", "refs": ["2 2", "2 3"], "lang": "en"},
    ]
    assert cli("tokenizer", "build", run, "tokenizer.num_data_tokens=100")[0] == 0
    code, printed, err = cli("data", "validate", "--files", str(out / "train.jsonl"), str(out / "valid.jsonl"), run,
                             *MAPPING)
    assert code == 0 and printed.count(" examples") == 2, err
    code, printed, _ = cli("data", "import", "--input", str(path), "--out", str(out), "--unlabeled", run, *MAPPING)
    assert code == 0 and "3 targets left out" in printed
    # (references are targets too: row 3's are left out with the rest)
    assert {tuple(sorted(json.loads(line))) for line in (out / "test.jsonl").open()} == {("doc_id", "document", "lang")}
    # A labeled re-import without test rows keeps that unlabeled test set: it is read with the same mapping.
    code, printed, _ = cli("data", "import", "--input", str(path), "--out", str(out), "--force", run, *MAPPING)
    assert code == 0 and "test: " + str(out / "test.jsonl") + " kept" in printed
