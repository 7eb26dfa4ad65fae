"""What a submission leaves alone (a flag set in the browser survives the terminal loop), and the limits every
backend shares: ids within the 32-bit id columns, no NUL in text the app stores or looks up (PostgreSQL
refuses both with a DataError; SQLite would not, so these SQLite-backed tests pin the API's own checks)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from rlt2t.common.config import load_config
from rlt2t.common.data import DataError
from rlt2t.services.annotation import export
from rlt2t.services.annotation.app import LOGIN_CSRF_COOKIE, create_app
from rlt2t.services.annotation.items import read_candidates
from rlt2t.services.annotation.store import NewItem, Store, Submission
from rlt2t.services.annotation.terminal import run_terminal


@pytest.fixture
def store(tmp_path):
    s = Store.open(f"sqlite:///{tmp_path}/a.db")
    s.add_items([NewItem("s1", ("a", "b"), "t")])
    yield s
    s.close()


@pytest.fixture
def app(store, tmp_path):
    cfg = load_config([], [f"run.dir={tmp_path}", "annotate.shuffle_candidates=false"])
    tokens = {"ann": store.add_annotator("ann"), "boss": store.add_annotator("boss", "admin")}
    with TestClient(create_app(cfg, store), base_url="http://127.0.0.1", raise_server_exceptions=False) as client:
        yield client, tokens


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


# --- the flag and the note ----------------------------------------------------------------------------------


def test_the_terminal_loop_keeps_a_flag_set_in_the_browser(store):
    store.add_annotator("ann")
    ann = store.annotator_by_name("ann")
    a, b = (c.id for c in store.item(1).candidates)
    store.submit(ann, Submission("web-000001", 1, "rate", ratings={a: 2.0}, flagged=True, note="source is garbage"))
    answers = iter(["-1"])
    result = run_terminal(store, ann, rating_range=(-2, 2), shuffle=False, read=lambda _: next(answers),
                          write=lambda _: None)
    assert result.rated == 1
    mine = store.annotation_of(ann, 1)
    assert (mine.status, mine.flagged, mine.note, mine.ratings) == ("rated", True, "source is garbage",
                                                                    {a: 2.0, b: -1.0})
    assert list(export.rating_rows(store)) == []  # flagged: out of the exports
    assert len(list(export.rating_rows(store, include_flagged=True))) == 2


def test_the_api_sets_keeps_and_clears_the_flag_and_note(app):
    client, tokens = app
    h = bearer(tokens["ann"])
    a, b = (c["id"] for c in client.get("/api/items/1", headers=h).json()["candidates"])

    def submit(sid: str, **fields) -> dict:
        r = client.post("/api/submissions", headers=h, json={"submission_id": sid, "item_id": 1, **fields})
        assert r.status_code == 200, r.text
        return r.json()["annotation"]

    new = submit("api-000001", action="rate", ratings=[{"candidate_id": a, "rating": 1}])
    assert (new["flagged"], new["note"]) == (False, "")  # a new annotation: no flag, no note
    flagged = submit("api-000002", action="rate", ratings=[{"candidate_id": a, "rating": 2}], flagged=True,
                     note="broken")
    assert (flagged["flagged"], flagged["note"]) == (True, "broken")
    kept = submit("api-000003", action="rate", ratings=[{"candidate_id": b, "rating": 0}])
    assert (kept["status"], kept["flagged"], kept["note"]) == ("rated", True, "broken")
    kept = submit("api-000004", action="skip", flagged=None, note=None)
    assert (kept["flagged"], kept["note"]) == (True, "broken")
    note_only = submit("api-000005", action="skip", note="still broken")
    assert (note_only["flagged"], note_only["note"]) == (True, "still broken")
    cleared = submit("api-000006", action="skip", flagged=False, note="")
    assert (cleared["flagged"], cleared["note"]) == (False, "")


# --- ids fit the 32-bit id columns --------------------------------------------------------------------------


# (ids beyond the columns: test_annotation_exports.test_huge_integers_are_a_422_naming_the_field)


def test_the_largest_id_is_an_ordinary_missing_one(app):
    client, tokens = app
    h = bearer(tokens["ann"])
    largest = 2**31 - 1
    assert client.get(f"/api/items/{largest}", headers=h).json() == {"detail": f"no item {largest}"}
    assert client.get(f"/api/annotations/{largest}", headers=h).status_code == 404
    r = client.post("/api/submissions", headers=h, json={"submission_id": "bigid0004", "item_id": largest,
                                                         "action": "skip"})
    assert r.status_code == 404


# --- no NUL in stored or queried text -----------------------------------------------------------------------


def test_nul_in_a_note_or_an_annotator_query_is_a_422_naming_the_field(app, store):
    client, tokens = app
    r = client.post("/api/submissions", headers=bearer(tokens["ann"]),
                    json={"submission_id": "nulnote01", "item_id": 1, "action": "skip", "flagged": True,
                          "note": "bad\u0000item"})
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["body", "note"] and "NUL" in r.json()["detail"][0]["msg"]
    assert store.annotation_of(store.annotator_by_name("ann"), 1) is None
    for who in ("boss", "ann"):
        r = client.get("/api/annotations", params={"annotator": "a\u0000b"}, headers=bearer(tokens[who]))
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "annotator"], r.text
    r = client.get("/api/annotations", params={"annotator": "ann"}, headers=bearer(tokens["boss"]))
    assert r.status_code == 200
    client.get("/login")
    login = client.post("/login", data={"name": "boss", "token": tokens["boss"],
                                        "csrf": client.cookies[LOGIN_CSRF_COOKIE]}, follow_redirects=False)
    assert login.status_code == 303
    r = client.get("/history", params={"annotator": "a\u0000b"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "annotator"]


@pytest.mark.parametrize("row, where", [
    ({"source": "s\u0000", "candidates": ["a", "b"]},
     "2: field 'source': contains a NUL character (\\u0000) at character 1"),
    ({"source": "s", "candidates": ["a", "\u0000b"]}, "2: field 'candidates': candidate 1: contains a NUL character"),
    ({"source": "s", "candidates": [{"text": "a\u0000"}]}, "2: field 'candidates': candidate 0: contains a NUL"),
    ({"id": "x\u0000", "source": "s", "candidates": ["a"]}, "2: field 'id': contains a NUL character"),
])
def test_read_candidates_refuses_nul_naming_file_line_and_field(tmp_path, row, where):
    path = tmp_path / "nul.jsonl"
    path.write_text(json.dumps({"source": "ok", "candidates": ["a"]}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError) as e:
        list(read_candidates(path, max_candidates=4, max_chars=100))
    assert str(e.value).startswith(f"{path}:{where}")


def test_sampled_items_leave_out_candidates_no_database_stores_and_refuse_such_sources(caplog):
    """A byte-level tokenizer can decode NUL: such a sampled candidate is dropped (counted in a warning), and a
    source that holds one is refused, naming its example, before anything is sampled."""
    from rlt2t.common.data import Example
    from rlt2t.services.annotation.items import sample_items
    from rlt2t.services.schemas import Candidate, CandidatesResponse

    class Server:  # the policy server's answers, as PolicyClient returns them
        base_url = "http://127.0.0.1:1"
        calls = 0

        def candidates(self, sources, **params):
            self.calls += 1
            texts = {"a": ["x", "y\x00z", "x"], "b": ["\x00"]}
            return CandidatesResponse(policy_version=3, candidates=[
                [Candidate(text=t, token_ids=[1], logprobs=[0.0], total_logprob=0.0, sample_logprobs=[0.0])
                 for t in texts[s]] for s in sources])

    server = Server()
    with caplog.at_level("WARNING", logger="rlt2t.services.annotation"):
        examples = [Example(id="1", source="a", target=None), Example(id="2", source="b", target=None)]
        items = sample_items(server, examples, num_candidates=3, top_k=0, temperature=1.0, max_new_tokens=4,
                             progress=False)
    assert [(i.source, i.candidates, i.ext_id, i.policy_version) for i in items] == [("a", ("x",), "1", 3)]
    assert any("2 sampled candidates left out" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match=r"source of example '9': contains a NUL"):
        sample_items(server, [Example(id="9", source="p\x00q", target=None)], num_candidates=3, top_k=0,
                     temperature=1.0, max_new_tokens=4, progress=False)
    assert server.calls == 1  # the bad source was refused before sampling


def test_loaded_items_that_cannot_be_ranked_or_trained_on_are_left_out_and_counted(tmp_path, ids_tokenizer_dir,
                                                                                   capsys):
    """`annotate load`: blank candidates dropped; an item left with fewer than two, or holding a text the run's
    tokenizer cannot read, is not queued (its export would stop `reward-model train` at its line)."""
    from rlt2t.cmd_annotate import _rankable

    items = [NewItem("1 2", ("3", "4 5", " ", "4\t5"), "f", "good"), NewItem("1 3", ("3", ""), "f", "one-left"),
             NewItem("1 4", ("hello", "4"), "f", "words")]
    cfg = load_config([], [f"run.dir={tmp_path}", f"tokenizer.path={ids_tokenizer_dir}"])  # integer-id texts
    kept = _rankable(cfg, items)
    assert [(i.ext_id, i.candidates) for i in kept] == [("good", ("3", "4 5"))]
    out = capsys.readouterr().out
    assert "2 items left out, which cannot be ranked or trained on (first: 'one-left': fewer than 2 distinct" in out
    no_tokenizer = load_config([], [f"run.dir={tmp_path / 'other'}"])  # nothing to check the texts with
    assert [i.ext_id for i in _rankable(no_tokenizer, items)] == ["good", "words"]


def test_queued_sources_are_those_with_items_of_the_policy_version_asked(store):
    store.add_items([NewItem("s1", ("a", "c"), "u", policy_version=0), NewItem("s2", ("a", "b"), "u", policy_version=1),
                     NewItem("s3", ("a", "b"), "file")])
    assert store.queued_sources(["s1", "s2", "s3", "s4"]) == {"s1", "s2", "s3"}
    assert store.queued_sources(["s1", "s2", "s3", "s4"], policy_version=1) == {"s2"}  # the next round: s1 again

