"""The annotation database against SQLite and a real PostgreSQL 15 server started in a temporary directory.

The server runs as the `postgres` user when the tests run as root (initdb and postgres refuse root), on a
unix socket in its own directory (no TCP port), with fsync off; one fresh database per test.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from rlt2t.common.config import load_config
from rlt2t.common.data import DataError
from rlt2t.services.annotation import export
from rlt2t.services.annotation.app import create_app
from rlt2t.services.annotation.items import read_candidates
from rlt2t.services.annotation.store import (
    SCHEMA_HEAD,
    NewItem,
    NotFound,
    Store,
    StoreError,
    Submission,
    SubmissionConflict,
    head_revision,
    schema_revision,
)
from rlt2t.services.annotation.tables import annotations, items, labels, metadata, submissions
from rlt2t.services.annotation.terminal import run_terminal

pytestmark = pytest.mark.integration

PG_BIN = Path("/usr/lib/postgresql/15/bin")


class PostgresServer:
    def __init__(self, socket_dir: str) -> None:
        self.socket_dir = socket_dir
        self._count = 0

    def new_database(self) -> str:
        """A fresh empty database; its SQLAlchemy URL."""
        import psycopg

        self._count += 1
        name = f"annotate_{self._count}"
        with psycopg.connect(host=self.socket_dir, user="postgres", dbname="postgres", autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return f"postgresql+psycopg://postgres@/{name}?host={self.socket_dir}"


@pytest.fixture(scope="session")
def postgres_server():
    """A PostgreSQL 15 server for this test session (skips, saying why, where it cannot run)."""
    if not (PG_BIN / "postgres").is_file():
        pytest.skip(f"PostgreSQL 15 server binaries not found in {PG_BIN} (Debian: apt-get install postgresql-15)")
    psycopg = pytest.importorskip("psycopg", reason="psycopg is not installed (pip install 'psycopg[binary]')")
    ids: dict = {}
    root = tempfile.mkdtemp(prefix="rlt2t-pg-")  # under /tmp: pytest's own tmp dirs are closed to other users
    if os.geteuid() == 0:
        try:
            account = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and no `postgres` user exists to run the PostgreSQL server as")
        os.chown(root, account.pw_uid, account.pw_gid)
        ids = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
    data = os.path.join(root, "data")
    subprocess.run([PG_BIN / "initdb", "-D", data, "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8",
                    "--locale=C"], check=True, capture_output=True, cwd=root, **ids)
    log = open(os.path.join(tempfile.gettempdir(), f"{os.path.basename(root)}.log"), "wb")  # noqa: SIM115
    proc = subprocess.Popen([PG_BIN / "postgres", "-D", data, "-k", root, "-c", "listen_addresses=", "-c", "fsync=off",
                             "-c", "synchronous_commit=off", "-c", "full_page_writes=off"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=root, **ids)
    deadline = time.monotonic() + 30
    while True:
        try:
            psycopg.connect(host=root, user="postgres", dbname="postgres").close()
            break
        except psycopg.OperationalError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"PostgreSQL did not start; see {log.name}") from None
            time.sleep(0.1)
    try:
        yield PostgresServer(root)
    finally:
        proc.send_signal(signal.SIGINT)  # "fast" shutdown: roll back open transactions, exit
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/annotations.db"
    return request.getfixturevalue("postgres_server").new_database()


@pytest.fixture
def store(db_url):
    s = Store.open(db_url)
    yield s
    s.close()


def _items(store: Store, n: int = 3, k: int = 3) -> list[int]:
    store.add_items([NewItem(f"source {i}", tuple(f"cand {i}.{j}" for j in range(k)), "test") for i in range(n)])
    with store.read() as conn:
        return list(conn.execute(select(items.c.id).order_by(items.c.id)).scalars())


def _count(store: Store, table) -> int:
    with store.read() as conn:
        return conn.execute(select(func.count()).select_from(table)).scalar_one()


def test_migrations_build_exactly_the_tables_and_refuse_an_unknown_revision(db_url):
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    store = Store.open(db_url)
    try:
        assert schema_revision(store) == head_revision() == SCHEMA_HEAD
        with store.read() as conn:
            assert compare_metadata(MigrationContext.configure(conn), metadata) == []
        store.add_annotator("keep")
    finally:
        store.close()
    again = Store.open(db_url)  # a second open migrates nothing and keeps the data
    try:
        assert again.annotator_by_name("keep") is not None
        with again.write() as conn:
            conn.exec_driver_sql("UPDATE alembic_version SET version_num = '9999'")
    finally:
        again.close()
    with pytest.raises(StoreError, match="schema revision '9999' is unknown"):
        Store.open(db_url)


def test_a_submission_is_one_transaction_and_its_id_makes_it_idempotent(store, monkeypatch):
    item_id = _items(store, n=1)[0]
    store.add_annotator("alice")
    store.add_annotator("bob")
    alice, bob = store.annotator_by_name("alice"), store.annotator_by_name("bob")
    ids = [c.id for c in store.item(item_id).candidates]
    rank = Submission("sub-0000001", item_id, "rank", order=tuple(reversed(ids)))

    # A crash after every write of the submission but before the commit leaves no trace ...
    def crash(*args, **kwargs):
        raise RuntimeError("power cut")

    with monkeypatch.context() as m:
        m.setattr(Store, "_annotation", crash)
        with pytest.raises(RuntimeError, match="power cut"):
            store.submit(alice, rank)
    assert (_count(store, annotations), _count(store, labels), _count(store, submissions)) == (0, 0, 0)
    # ... so the client's retry under the same id applies it once, and a double submit changes nothing.
    first = store.submit(alice, rank)
    assert not first.duplicate and first.annotation.order == tuple(reversed(ids))
    again = store.submit(alice, rank)
    assert again.duplicate and again.annotation == first.annotation
    assert (_count(store, annotations), _count(store, labels), _count(store, submissions)) == (1, len(ids), 1)
    # The same id with other content, or from another annotator, is refused.
    with pytest.raises(SubmissionConflict):
        store.submit(alice, Submission("sub-0000001", item_id, "rank", order=tuple(ids)))
    with pytest.raises(SubmissionConflict):
        store.submit(bob, rank)
    # An edit is a new submission; a late duplicate of the older one does not undo it.
    store.submit(alice, Submission("sub-0000002", item_id, "rank", order=tuple(ids)))
    assert store.submit(alice, rank).duplicate
    assert store.annotation_of(alice, item_id).order == tuple(ids)


def test_concurrent_double_submits_write_once(store):
    item_id = _items(store, n=1, k=4)[0]
    store.add_annotator("alice")
    alice = store.annotator_by_name("alice")
    ids = tuple(c.id for c in store.item(item_id).candidates)
    outcomes, errors = [], []
    barrier = threading.Barrier(6)

    def send(sub: Submission) -> None:
        barrier.wait()
        try:
            outcomes.append(store.submit(alice, sub))
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    same = Submission("double-click-1", item_id, "rank", order=ids)
    threads = [threading.Thread(target=send, args=(same,)) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert sorted(o.duplicate for o in outcomes) == [False] + [True] * 5
    assert (_count(store, annotations), _count(store, labels), _count(store, submissions)) == (1, 4, 1)

    # Six different submissions to the same item at once (two tabs): one annotation, the labels of one of them.
    barrier.reset()
    orders = [ids[i:] + ids[:i] for i in range(4)] + [ids[::-1], ids]
    threads = [threading.Thread(target=send, args=(Submission(f"tab-{i:08d}", item_id, "rank", order=o),))
               for i, o in enumerate(orders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert (_count(store, annotations), _count(store, labels), _count(store, submissions)) == (1, 4, 7)
    assert store.annotation_of(alice, item_id).order in orders


def test_ratings_merge_rankings_replace_skips_clear(store):
    item_id = _items(store, n=1)[0]
    store.add_annotator("ann")
    ann = store.annotator_by_name("ann")
    a, b, c = (x.id for x in store.item(item_id).candidates)
    out = store.submit(ann, Submission("rate-000001", item_id, "rate", ratings={a: 1.5})).annotation
    assert (out.status, out.ratings) == ("partial", {a: 1.5})
    assert store.next_item(ann).id == item_id  # partly rated: still in the queue
    out = store.submit(ann, Submission("rate-000002", item_id, "rate", ratings={b: -2.0, c: 0.25})).annotation
    assert (out.status, out.ratings) == ("rated", {a: 1.5, b: -2.0, c: 0.25})
    out = store.submit(ann, Submission("rate-000003", item_id, "rate", ratings={a: 2.0})).annotation
    assert out.ratings == {a: 2.0, b: -2.0, c: 0.25}
    out = store.submit(ann, Submission("rank-000001", item_id, "rank", order=(c, a, b), flagged=True,
                                       note="odd")).annotation
    assert (out.status, out.order, out.ratings, out.flagged, out.note) == ("ranked", (c, a, b), {}, True, "odd")
    out = store.submit(ann, Submission("skip-000001", item_id, "skip", flagged=False)).annotation
    assert (out.status, out.order, out.flagged, out.note) == ("skipped", (), False, "odd")  # no note given: kept
    assert _count(store, labels) == 0


def test_queue_progress_and_visibility(store):
    first, second, third = _items(store, n=3, k=2)
    for name, role in (("a", "annotator"), ("b", "annotator"), ("c", "annotator"), ("boss", "admin")):
        store.add_annotator(name, role)
    a, b, c, boss = (store.annotator_by_name(n) for n in ("a", "b", "c", "boss"))

    def rank(who, item_id, sid):
        ids = tuple(x.id for x in store.item(item_id).candidates)
        return store.submit(who, Submission(sid, item_id, "rank", order=ids)).annotation

    mine = rank(a, first, "a-0000001")
    store.submit(a, Submission("a-0000002", second, "skip", flagged=True, note="garbage"))
    p = store.progress(a)
    assert (p.done, p.left, p.skipped, p.flagged) == (2, 1, 1, 1)
    assert store.next_item(a).id == third
    rank(b, first, "b-0000001")
    # With at most two annotators per item, c never gets the first item (a and b finished it).
    assert store.next_item(c, max_per_item=2).id == second
    assert store.progress(c, max_per_item=2).left == 2
    assert store.progress(c).left == 3
    # Nobody but the owner and admins can read an annotation.
    assert store.annotation(mine.id, a) == mine
    assert store.annotation(mine.id, boss) == mine
    with pytest.raises(NotFound):
        store.annotation(mine.id, b)
    assert store.annotation_of(b, second) is None
    assert {r.annotator for r in store.annotations(b)[0]} == {"b"}
    assert store.annotations(boss)[1] == 3 and store.annotations(boss, annotator="a")[1] == 2


def test_sessions_expire_and_token_reset_revokes(store):
    store.add_annotator("s")
    who = store.annotator_by_name("s")
    live, csrf = store.create_session(who, ttl_s=3600)
    dead, _ = store.create_session(who, ttl_s=-1)
    assert store.session(live) == (who, csrf) and store.session(dead) is None
    token = store.reset_token("s")
    assert store.session(live) is None and store.annotator_by_token(token) == who


def test_exports_in_the_trainers_formats(store, tmp_path):
    store.add_items([NewItem("src\tone", ("best", "mid\nline", "worst"), "t"), NewItem("src two", ("p", "q"), "t"),
                     NewItem("src three", ("u", "v"), "t")])
    for name in ("x", "y"):
        store.add_annotator(name)
    x, y = store.annotator_by_name("x"), store.annotator_by_name("y")
    one = store.next_item(x).id
    ids = {c.text: c.id for c in store.item(one).candidates}
    store.submit(x, Submission("x-00000001", one, "rank", order=(ids["best"], ids["mid\nline"], ids["worst"])))
    two = store.next_item(x).id
    pq = {c.text: c.id for c in store.item(two).candidates}
    store.submit(x, Submission("x-00000002", two, "rate", ratings={pq["q"]: 1.0, pq["p"]: -0.5}))
    three = store.next_item(x).id
    uv = {c.text: c.id for c in store.item(three).candidates}
    store.submit(x, Submission("x-00000003", three, "rank", order=(uv["v"], uv["u"]), flagged=True))
    store.submit(y, Submission("y-00000001", one, "rank", order=(ids["worst"], ids["best"], ids["mid\nline"])))

    counts = export.export_all(store, tmp_path / "out")
    assert (counts.rank_lists, counts.pairs, counts.ratings, counts.cleaned) == (2, 6, 2, 4)
    assert (tmp_path / "out" / "ranks.tsv").read_text() == (
        "src one\tbest\tmid line\tworst\n"
        "src one\tworst\tbest\tmid line\n")
    pairs = [json.loads(line) for line in (tmp_path / "out" / "pairs.jsonl").read_text().splitlines()]
    assert pairs[:3] == [{"source": "src\tone", "chosen": "best", "rejected": "mid\nline"},
                         {"source": "src\tone", "chosen": "best", "rejected": "worst"},
                         {"source": "src\tone", "chosen": "mid\nline", "rejected": "worst"}]
    assert all(set(p) == {"source", "chosen", "rejected"} for p in pairs)
    ratings = [json.loads(line) for line in (tmp_path / "out" / "ratings.jsonl").read_text().splitlines()]
    assert sorted(ratings, key=lambda r: r["rating"]) == [{"source": "src two", "candidate": "p", "rating": -0.5},
                                                          {"source": "src two", "candidate": "q", "rating": 1.0}]
    flagged_too = export.export_all(store, tmp_path / "all", include_flagged=True, annotator="x")
    assert (flagged_too.rank_lists, flagged_too.pairs) == (2, 4)
    assert (tmp_path / "all" / "ranks.tsv").read_text().splitlines()[1] == "src three\tv\tu"



def test_flags_survive_ratings_and_limits_answer_alike_on_every_backend(store, tmp_path):
    """PostgreSQL's integer ids end at 2**31 - 1 and its text refuses NUL: both are a 422 naming the field (not a
    500 DataError), on SQLite as on PostgreSQL; a rating that says nothing of the flag keeps it."""
    _items(store, n=1, k=2)
    tokens = {"ann": store.add_annotator("ann"), "boss": store.add_annotator("boss", "admin")}
    ann = store.annotator_by_name("ann")
    item = store.next_item(ann)
    a, b = (c.id for c in item.candidates)
    store.submit(ann, Submission("web-000001", item.id, "rate", ratings={a: 1.0}, flagged=True, note="garbage"))
    answers = iter(["-1"])
    run_terminal(store, ann, rating_range=(-2, 2), shuffle=False, read=lambda _: next(answers), write=lambda _: None)
    mine = store.annotation_of(ann, item.id)
    assert (mine.status, mine.flagged, mine.note) == ("rated", True, "garbage")
    assert list(export.rating_rows(store)) == []

    cfg = load_config([], [f"run.dir={tmp_path}"])
    with TestClient(create_app(cfg, store), base_url="http://127.0.0.1", raise_server_exceptions=False) as client:
        h = {"Authorization": f"Bearer {tokens['ann']}"}
        assert client.get(f"/api/items/{2**31 - 1}", headers=h).status_code == 404
        for path, loc in ((f"/api/items/{2**31}", ["path", "item_id"]),
                          (f"/api/annotations/{2**31}", ["path", "annotation_id"])):
            r = client.get(path, headers=h)
            assert r.status_code == 422 and r.json()["detail"][0]["loc"] == loc, r.text
        r = client.post("/api/submissions", headers=h, json={"submission_id": "bigid0001", "item_id": 2**31,
                                                             "action": "skip"})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "item_id"], r.text
        r = client.post("/api/submissions", headers=h, json={"submission_id": "nulnote01", "item_id": item.id,
                                                             "action": "skip", "note": "bad\u0000"})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "note"], r.text
        r = client.get("/api/annotations", params={"annotator": "a\u0000b"},
                       headers={"Authorization": f"Bearer {tokens['boss']}"})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "annotator"], r.text

    path = tmp_path / "nul.jsonl"
    path.write_text(json.dumps({"source": "s\u0000", "candidates": ["a", "b"]}) + "\n")
    with pytest.raises(DataError, match="nul.jsonl:1: field 'source': contains a NUL character"):
        store.add_items(list(read_candidates(path, max_candidates=4, max_chars=100)))
