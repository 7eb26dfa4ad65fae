"""The annotation API's edges shared with the other servers, and its revisions: strict request types, 415 for a
body that is not JSON (or not UTF-8), the OpenAPI document behind the login, and a submission made against a
revision the item has moved past (another tab's save) refused with 409 until it is sent as an overwrite."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import insert, select

from rlt2t.common.config import load_config
from rlt2t.services.annotation.app import LOGIN_CSRF_COOKIE, create_app
from rlt2t.services.annotation.store import SCHEMA_HEAD, NewItem, StaleRevision, Store, Submission, upgrade
from rlt2t.services.annotation.tables import annotations, annotators, submissions


@pytest.fixture
def store(tmp_path):
    s = Store.open(f"sqlite:///{tmp_path}/a.db")
    s.add_items([NewItem("s1", ("a", "b", "c"), "t")])
    yield s
    s.close()


@pytest.fixture
def app(store, tmp_path):
    cfg = load_config([], [f"run.dir={tmp_path}", "annotate.shuffle_candidates=false"])
    tokens = {"ann": store.add_annotator("ann")}
    with TestClient(create_app(cfg, store), base_url="http://127.0.0.1", raise_server_exceptions=False) as client:
        yield client, tokens


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def ids(client: TestClient, h: dict[str, str]) -> list[int]:
    return [c["id"] for c in client.get("/api/items/1", headers=h).json()["candidates"]]


# --- strict types, content types, UTF-8 ---------------------------------------------------------------------


@pytest.mark.parametrize(("fields", "loc"), [
    ({"action": "rank", "order": "strings"}, ["body", "order", 0]),
    ({"action": "skip", "item_id": "1"}, ["body", "item_id"]),
    ({"action": "skip", "flagged": "true"}, ["body", "flagged"]),
    ({"action": "skip", "flagged": 1}, ["body", "flagged"]),
    ({"action": "rate", "ratings": [{"candidate_id": "1", "rating": 1}]}, ["body", "ratings", 0, "candidate_id"]),
    ({"action": "rate", "ratings": [{"candidate_id": 1, "rating": "1.5"}]}, ["body", "ratings", 0, "rating"]),
    ({"action": "skip", "base_revision": "0"}, ["body", "base_revision"]),
])
def test_numbers_and_booleans_are_not_read_from_strings(app, store, fields, loc):
    client, tokens = app
    h = bearer(tokens["ann"])
    if fields.get("order") == "strings":
        fields = {**fields, "order": [str(i) for i in ids(client, h)]}
    r = client.post("/api/submissions", headers=h, json={"submission_id": "strict-001", "item_id": 1, **fields})
    assert r.status_code == 422, r.text
    assert loc in [e["loc"] for e in r.json()["detail"]], r.json()
    assert store.annotation_of(store.annotator_by_name("ann"), 1) is None


def test_a_rating_given_as_an_integer_is_still_a_number(app):
    client, tokens = app
    h = bearer(tokens["ann"])
    ratings = [{"candidate_id": c, "rating": 1} for c in ids(client, h)]
    r = client.post("/api/submissions", headers=h, json={"submission_id": "int-rating-1", "item_id": 1,
                                                         "action": "rate", "ratings": ratings})
    assert r.status_code == 200 and r.json()["annotation"]["status"] == "rated"


BODY = {"submission_id": "encoded-01", "item_id": 1, "action": "skip", "flagged": True, "note": "café"}


@pytest.mark.parametrize(("content_type", "wanted"), [
    ("text/plain", "application/json"),
    ("application/x-www-form-urlencoded", "application/json"),
    ("application/json; charset=utf-16", "application/json"),
    (None, "application/json"),
])
def test_a_submission_not_sent_as_json_is_a_415_as_on_the_other_servers(app, content_type, wanted):
    client, tokens = app
    headers = {**bearer(tokens["ann"]), **({"content-type": content_type} if content_type else {})}
    r = client.post("/api/submissions", headers=headers, content=json.dumps(BODY).encode())
    assert r.status_code == 415, r.text
    assert wanted in r.json()["detail"]


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "latin-1"])
def test_a_body_not_in_utf8_is_a_415_naming_utf8(app, store, encoding):
    client, tokens = app
    body = json.dumps(BODY, ensure_ascii=False).encode(encoding)
    r = client.post("/api/submissions", headers={**bearer(tokens["ann"]), "content-type": "application/json"},
                    content=body)
    assert r.status_code == 415, r.text
    assert "UTF-8" in r.json()["detail"]
    assert store.annotation_of(store.annotator_by_name("ann"), 1) is None


def test_the_same_body_in_utf8_is_stored_as_sent(app, store):
    client, tokens = app
    r = client.post("/api/submissions", headers={**bearer(tokens["ann"]), "content-type": "application/json"},
                    content=json.dumps({**BODY, "note": "café ✓"}, ensure_ascii=False).encode("utf-8"))
    assert r.status_code == 200, r.text
    assert store.annotation_of(store.annotator_by_name("ann"), 1).note == "café ✓"


def test_the_login_form_must_be_a_form_in_utf8(app):
    client, tokens = app
    client.get("/login")
    csrf = client.cookies[LOGIN_CSRF_COOKIE]
    form = f"name=ann&token={tokens['ann']}&csrf={csrf}"
    r = client.post("/login", content=json.dumps({"name": "ann"}).encode(),
                    headers={"content-type": "application/json"})
    assert r.status_code == 415 and "application/x-www-form-urlencoded" in r.json()["detail"]
    r = client.post("/login", content=form.encode("utf-16"),
                    headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415 and "UTF-8" in r.json()["detail"]
    r = client.post("/login", content=form.encode(), headers={"content-type": "application/x-www-form-urlencoded"},
                    follow_redirects=False)
    assert r.status_code == 303


# --- the OpenAPI document behind the login ------------------------------------------------------------------


def test_the_openapi_document_needs_a_login(app):
    client, tokens = app
    for path in ("/openapi.json", "/docs", "/redoc"):
        r = client.get(path)
        assert r.status_code in (401, 404) and "paths" not in r.text, path
    assert client.get("/openapi.json").status_code == 401
    doc = client.get("/openapi.json", headers=bearer(tokens["ann"]))
    assert doc.status_code == 200 and "/api/submissions" in doc.json()["paths"]
    assert "/openapi.json" not in doc.json()["paths"]
    client.get("/login")
    client.post("/login", data={"name": "ann", "token": tokens["ann"], "csrf": client.cookies[LOGIN_CSRF_COOKIE]})
    assert client.get("/openapi.json").status_code == 200  # a browser session reads it too


# --- revisions: no silent overwrite of a save made elsewhere ------------------------------------------------


def test_a_submission_against_a_stale_revision_is_a_409_until_sent_as_an_overwrite(app, store):
    client, tokens = app
    h = bearer(tokens["ann"])
    a, b, c = ids(client, h)

    def post(sid: str, order: list[int], base: int | None):
        body = {"submission_id": sid, "item_id": 1, "action": "rank", "order": order}
        if base is not None:
            body["base_revision"] = base
        return client.post("/api/submissions", headers=h, json=body)

    # Two tabs load the item before either saves: both build on revision 0 (no annotation yet).
    first = post("tab-one-001", [a, b, c], 0)
    assert first.status_code == 200 and first.json()["annotation"]["revision"] == 1
    second = post("tab-two-001", [c, b, a], 0)
    assert second.status_code == 409, second.text
    stale = second.json()
    assert stale["revision"] == 1 and stale["annotation"]["order"] == [a, b, c]
    assert "base_revision 1" in stale["detail"]
    ann = store.annotator_by_name("ann")
    assert store.annotation_of(ann, 1).order == (a, b, c)  # nothing changed
    assert client.get("/api/items/1", headers=h).json()["annotation"]["revision"] == 1

    # The refused id was not used up: the explicit overwrite may carry it, against the current revision.
    again = post("tab-two-001", [c, b, a], 1)
    assert again.status_code == 200 and again.json()["annotation"]["revision"] == 2
    assert store.annotation_of(ann, 1).order == (c, b, a)
    # A resend of an applied submission is answered from its record whatever revision it names.
    assert post("tab-one-001", [a, b, c], 0).json()["duplicate"] is True
    # No base_revision (scripts, the terminal loop): applied over whatever is stored.
    free = post("script-0001", [b, a, c], None)
    assert free.status_code == 200 and free.json()["annotation"]["revision"] == 3
    # A base past the stored revision is stale too (a database restored from a backup).
    assert post("future-0001", [a, c, b], 9).status_code == 409


def test_store_revisions_count_applied_submissions_only(store):
    store.add_annotator("ann")
    ann = store.annotator_by_name("ann")
    a, b, _ = (c.id for c in store.item(1).candidates)
    assert store.submit(ann, Submission("rev-000001", 1, "rate", ratings={a: 1.0}, base_revision=0)
                        ).annotation.revision == 1
    assert store.submit(ann, Submission("rev-000001", 1, "rate", ratings={a: 1.0}, base_revision=0)).duplicate
    assert store.submit(ann, Submission("rev-000002", 1, "rate", ratings={b: 0.5})).annotation.revision == 2
    with pytest.raises(StaleRevision) as e:
        store.submit(ann, Submission("rev-000003", 1, "skip", base_revision=1))
    assert (e.value.revision, e.value.current.ratings) == (2, {a: 1.0, b: 0.5})
    with store.read() as conn:
        assert conn.execute(select(submissions.c.id).where(submissions.c.id == "rev-000003")).first() is None


def test_migrating_an_older_database_starts_its_annotations_at_revision_1(tmp_path):
    url = f"sqlite:///{tmp_path}/old.db"
    old = Store.open(url, migrate=False)
    try:
        upgrade(old, "0001")
        with old.write() as conn:  # what revision 0001's code wrote: no revision column
            who = conn.execute(insert(annotators).values(name="ann", role="annotator", token_sha256="x" * 64,
                                                         created_at=0.0).returning(annotators.c.id)).scalar_one()
        old.add_items([NewItem("s1", ("a", "b"), "t")])
        with old.write() as conn:
            conn.execute(insert(annotations).values(annotator_id=who, item_id=1, status="skipped", flagged=False,
                                                    note="", submission_id="old-000001", created_at=0.0,
                                                    updated_at=0.0))
    finally:
        old.close()
    store = Store.open(url)
    try:
        assert SCHEMA_HEAD == "0002"
        ann = store.annotator_by_name("ann")
        assert store.annotation_of(ann, 1).revision == 1
        assert store.submit(ann, Submission("new-000001", 1, "skip", base_revision=1)).annotation.revision == 2
    finally:
        store.close()
