"""Annotation exports the reward-model trainer must accept, and the app's edges: merged ratings, rank lists
without blank or repeated candidates, bounded ids, candidates files with unencodable text, the queue's cap,
and the page script's resend after a failed submission (driven in Node with a fake DOM)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from rlt2t.common.config import load_config
from rlt2t.common.preferences import read_pairs, read_rank_lists, read_ratings
from rlt2t.services.annotation import export
from rlt2t.services.annotation.app import create_app
from rlt2t.services.annotation.store import NewItem, Store, Submission

STATIC = Path(__file__).resolve().parents[3] / "services" / "annotation" / "static" / "annotate.js"


@pytest.fixture
def store(tmp_path):
    s = Store.open(f"sqlite:///{tmp_path}/a.db")
    yield s
    s.close()


def _ids(store: Store, item_id: int) -> dict[str, int]:
    return {c.text: c.id for c in store.item(item_id).candidates}


# --- ratings: one row per (source, candidate) ---------------------------------------------------------------


def test_ratings_of_several_annotators_merge_into_their_mean(store, tmp_path):
    store.add_items([NewItem("p1", ("x", "y"), "t"), NewItem("p1", ("x", "z"), "t"), NewItem("p2", ("u", " "), "t")])
    for name in ("ann", "bob"):
        store.add_annotator(name)
    ann, bob = store.annotator_by_name("ann"), store.annotator_by_name("bob")
    one, two, three = _ids(store, 1), _ids(store, 2), _ids(store, 3)
    store.submit(ann, Submission("ann-rate-1", 1, "rate", ratings={one["x"]: 1.0, one["y"]: -1.0}))
    store.submit(bob, Submission("bob-rate-1", 1, "rate", ratings={one["x"]: 2.0, one["y"]: 0.0}))
    # Another item with the same source rates "x" again: merged too (the trainer groups by source).
    store.submit(bob, Submission("bob-rate-2", 2, "rate", ratings={two["x"]: 0.0, two["z"]: 1.0}))
    store.submit(ann, Submission("ann-rate-3", 3, "rate", ratings={three["u"]: 1.0, three[" "]: 0.0}))

    counts = export.export_all(store, tmp_path / "out")
    rows = [json.loads(line) for line in (tmp_path / "out" / "ratings.jsonl").read_text().splitlines()]
    assert rows == [{"source": "p1", "candidate": "x", "rating": 1.0, "raters": 3},
                    {"source": "p1", "candidate": "y", "rating": -0.5, "raters": 2},
                    {"source": "p1", "candidate": "z", "rating": 1.0},
                    {"source": "p2", "candidate": "u", "rating": 1.0}]
    assert (counts.ratings, counts.merged_ratings, counts.dropped_ratings) == (4, 3, 1)
    groups = read_ratings(tmp_path / "out" / "ratings.jsonl")  # the trainer's reader accepts it
    assert [(g.source, g.candidates) for g in groups] == [("p1", ("x", "y", "z"))]  # p2: one rating, no pair

    # one annotator's work alone; an annotator the store does not know is refused before the export is replaced
    assert export.export_all(store, tmp_path / "bob", annotator="bob").ratings == 3
    before = (tmp_path / "out" / "ratings.jsonl").read_text()
    with pytest.raises(ValueError, match=r"--annotator nobody: no such annotator \(known: ann, bob\)"):
        export.export_all(store, tmp_path / "out", annotator="nobody")
    assert (tmp_path / "out" / "ratings.jsonl").read_text() == before


# --- rank lists: no blank or repeated candidate ---------------------------------------------------------------


def test_rank_exports_drop_blank_and_cleaned_duplicate_candidates(store, tmp_path, caplog):
    store.add_items([NewItem("p1", ("x", "y"), "t"), NewItem("p2", ("", "u", "v"), "t"),
                     NewItem("p3", ("a\tb", "a b"), "t"), NewItem("p4", ("a b", "c", "a\nb", "\t"), "t"),
                     NewItem("p5", ("3 ", " 3", "4"), "t")])
    store.add_annotator("ann")
    ann = store.annotator_by_name("ann")
    for item_id in (1, 2, 3, 4, 5):
        order = tuple(c.id for c in store.item(item_id).candidates)
        store.submit(ann, Submission(f"ann-rank-{item_id}", item_id, "rank", order=order))

    with caplog.at_level("WARNING", logger="rlt2t.services.annotation"):
        counts = export.export_all(store, tmp_path / "out")
    assert (tmp_path / "out" / "ranks.tsv").read_text() == "p1\tx\ty\np2\tu\tv\np4\ta b\tc\np5\t3 \t4\n"
    # p2 loses "", p3 keeps "a\tb" (ranked better) alone and goes, p4 loses "a\nb" and "\t", p5 " 3".
    assert (counts.rank_lists, counts.pairs, counts.dropped_candidates, counts.dropped_lists) == (4, 4, 5, 1)
    assert "5 blank or" in caplog.text and "1 rankings left out" in caplog.text
    assert [g.candidates for g in read_rank_lists(tmp_path / "out" / "ranks.tsv")] == [
        ("x", "y"), ("u", "v"), ("a b", "c"), ("3 ", "4")]
    assert [g.candidates for g in read_pairs(tmp_path / "out" / "pairs.jsonl")] == [
        ("x", "y"), ("u", "v"), ("a b", "c"), ("3 ", "4")]


def test_downloaded_rank_exports_are_readable_too(store, tmp_path):
    cfg = load_config([], [f"run.dir={tmp_path}", "annotate.shuffle_candidates=false"])
    store.add_items([NewItem("p", ("a\tb", "a b", "", "c"), "t")])
    token = store.add_annotator("boss", "admin")
    boss = store.annotator_by_name("boss")
    store.submit(boss, Submission("boss-rank-1", 1, "rank", order=tuple(c.id for c in store.item(1).candidates)))
    with TestClient(create_app(cfg, store), base_url="http://127.0.0.1") as client:
        for name, reader, kept in (("ranks.tsv", read_rank_lists, ("a b", "c")),
                                   ("pairs.jsonl", read_pairs, ("a\tb", "c"))):
            r = client.get(f"/api/admin/export/{name}", headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 200
            (tmp_path / name).write_bytes(r.content)
            assert [g.candidates for g in reader(tmp_path / name)] == [kept]


# --- ids and offsets are bounded ------------------------------------------------------------------------------


BIG = 2**70
OVER = 2**31  # one past the 32-bit id columns (PostgreSQL's integer: a DataError, a 500, before the bound)


@pytest.mark.parametrize("method, path, body, loc", [
    ("GET", f"/api/items/{BIG}", None, ["path", "item_id"]),
    ("GET", f"/api/items/{OVER}", None, ["path", "item_id"]),
    ("GET", f"/api/items/{-OVER}", None, ["path", "item_id"]),
    ("GET", f"/api/annotations/{OVER}", None, ["path", "annotation_id"]),
    ("GET", f"/items/{OVER}", None, ["path", "item_id"]),
    ("GET", f"/api/annotations?offset={BIG}", None, ["query", "offset"]),
    ("GET", f"/api/annotations?offset={2**62}", None, ["query", "offset"]),
    ("POST", "/api/submissions", {"submission_id": "abcdefgh1", "item_id": OVER, "action": "skip"},
     ["body", "item_id"]),
    ("POST", "/api/submissions", {"submission_id": "abcdefgh2", "item_id": 1, "action": "rank", "order": [OVER, 2]},
     ["body", "order", 0]),
    ("POST", "/api/submissions", {"submission_id": "abcdefgh3", "item_id": 1, "action": "rate",
                                  "ratings": [{"candidate_id": OVER, "rating": 1}]},
     ["body", "ratings", 0, "candidate_id"]),
])
def test_huge_integers_are_a_422_naming_the_field(store, tmp_path, method, path, body, loc):
    cfg = load_config([], [f"run.dir={tmp_path}"])
    store.add_items([NewItem("s", ("a", "b"), "t")])
    token = store.add_annotator("ann")
    with TestClient(create_app(cfg, store), base_url="http://127.0.0.1", raise_server_exceptions=False) as client:
        r = client.request(method, path, json=body, headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 422, r.text
        assert [d["loc"] for d in r.json()["detail"]] == [loc]
        assert client.get("/api/items/1", headers={"Authorization": f"Bearer {token}"}).status_code == 200


def test_history_page_number_is_bounded(store, tmp_path):
    cfg = load_config([], [f"run.dir={tmp_path}"])
    token = store.add_annotator("ann")
    with TestClient(create_app(cfg, store), base_url="http://127.0.0.1", raise_server_exceptions=False) as client:
        client.get("/login")
        login = client.post("/login", data={"name": "ann", "token": token, "csrf": client.cookies["rlt2t_login_csrf"]},
                            follow_redirects=False)
        assert login.status_code == 303
        assert client.get("/history?page=3").status_code == 200
        r = client.get(f"/history?page={2**60}")
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "page"]


# --- candidates files ----------------------------------------------------------------------------------------


# --- the queue's cap -----------------------------------------------------------------------------------------


def test_skips_do_not_count_toward_max_annotators_per_item(store):
    store.add_items([NewItem("p1", ("x", "y"), "t"), NewItem("p2", ("x", "y"), "t")])
    for name in ("a", "b", "c"):
        store.add_annotator(name)
    a, b, c = (store.annotator_by_name(n) for n in "abc")
    store.submit(a, Submission("a-skip-0001", 1, "skip"))
    assert store.next_item(b, max_per_item=1).id == 1  # a skipped it: it still wants its one judgement
    assert store.progress(b, max_per_item=1).left == 2
    store.submit(b, Submission("b-rank-0001", 1, "rank", order=tuple(_ids(store, 1).values())))
    assert store.next_item(c, max_per_item=1).id == 2
    assert store.progress(c, max_per_item=1).left == 1


# --- the page script: a resend after a failed submission ----------------------------------------------------

HARNESS = r"""
const fs = require("fs");
class El {
  constructor(tag, id) { this.tagName = tag; this.id = id; this.children = []; this.listeners = {};
    this.dataset = {}; this.textContent = ""; this.hidden = false; this.className = ""; this.value = "";
    this.classList = { add() {}, remove() {}, toggle() {} }; }
  addEventListener(t, f) { (this.listeners[t] ||= []).push(f); }
  setAttribute() {} focus() {}
  append(...xs) { this.children.push(...xs); }
  replaceChildren(...xs) { this.children = []; this.append(...xs); }
  get firstElementChild() { return this.children[0] || null; }
  querySelector(sel) { return this.children.find((c) => c.className.split(" ").includes(sel.slice(1))) || null; }
  click() { for (const f of this.listeners.click || []) f({}); }
}
const els = {};
const byId = (id) => (els[id] ||= new El("div", id));
global.document = { body: Object.assign(new El("body"), { dataset: { mode: "rank", itemId: "", annotator: "ann",
  ratingMin: "-2", ratingMax: "2", ratingStep: "0.5" } }),
  querySelector: () => ({ content: "csrf" }), getElementById: byId, createElement: (t) => new El(t),
  addEventListener() {} };
const storage = (stored) => ({ getItem: (k) => stored[k] ?? null, setItem: (k, v) => { stored[k] = v; },
  removeItem: (k) => { delete stored[k]; }, key: (i) => Object.keys(stored)[i] ?? null,
  get length() { return Object.keys(stored).length; } });
global.localStorage = storage({});
global.sessionStorage = storage({});
global.BroadcastChannel = undefined;  // one tab here
global.location = { assign() {}, pathname: "/" };
let failures = 0; let staleAt = null; let revision = 0; const sent = [];
const item = { item_id: 1, source: "s", candidates: [1, 2, 3].map((id) => ({ id, text: "t" + id })), annotation: null };
const progress = { done: 0, left: 1, skipped: 0, flagged: 0 };
global.fetch = async (path, init) => {
  if (init.method === "POST") {
    if (failures > 0) { failures -= 1; throw new TypeError("network down"); }
    const payload = JSON.parse(init.body);
    if (staleAt !== null && payload.base_revision !== staleAt) {  // saved elsewhere: at revision staleAt
      return { status: 409, ok: false, statusText: "Conflict",
               json: async () => ({ detail: "saved elsewhere", revision: staleAt, annotation: null }) };
    }
    sent.push(payload);
    revision += 1;
    return { status: 200, ok: true, json: async () => ({ annotation: { revision }, duplicate: false, progress }) };
  }
  return { status: 200, ok: true, json: async () => ({ item, progress }) };
};
eval(fs.readFileSync(process.argv[2], "utf8"));
const tick = () => new Promise((r) => setTimeout(r, 20));
const list = byId("candidates");
const submit = async () => { byId("submit").click(); await tick(); };
(async () => {
  await tick();
  const out = {};
  failures = 1; await submit();                  // fails: kept as pending
  await submit();                                // nothing changed on screen: resent under the same id
  out.unchanged = sent.map((b) => [b.order, b.submission_id]);
  sent.length = 0;
  failures = 1; await submit();                  // fails again
  list.children.reverse();                       // the annotator reorders before pressing Enter again
  failures = 1; await submit();                  // the stale one fails again: nothing new is sent
  out.staleStillUnsent = sent.length;
  await submit();                                // stale one first (its own id), then the screen's order
  out.changed = sent.map((b) => [b.order, b.submission_id, b.base_revision]);
  out.status = byId("status").textContent;
  out.pending = localStorage.getItem("rlt2t.pending.1.ann");
  out.places = list.children.map((li) => li.children[0].textContent);

  // Another tab saved the item (revision 7): the submission is refused, the notice shows, Enter sends nothing
  // more, and only "Overwrite" sends the screen, against revision 7.
  sent.length = 0; staleAt = 7;
  await submit();
  out.conflictShown = !byId("conflict").hidden;
  out.staleStatus = byId("status").textContent;
  await submit();
  out.sentWhileConflict = sent.length;
  byId("overwrite").click(); await tick();
  out.overwrite = sent.map((b) => b.base_revision);
  out.conflictAfter = !byId("conflict").hidden;
  console.log(JSON.stringify(out));
})();
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js to run the page script")
def test_the_page_resends_a_pending_submission_only_while_the_screen_still_shows_it(tmp_path):
    harness = tmp_path / "harness.js"
    harness.write_text(HARNESS)
    run = subprocess.run(["node", str(harness), str(STATIC)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    (order, sid), = out["unchanged"]
    assert order == [1, 2, 3] and len(sid) == 32
    assert out["staleStillUnsent"] == 0
    (stale, stale_id, stale_base), (new, new_id, new_base) = out["changed"]
    assert stale == [1, 2, 3] and new == [3, 2, 1] and stale_id != new_id
    # The new order builds on the page's own earlier try, which moved the revision from 0 to 1.
    assert (stale_base, new_base) == (0, 1)
    assert out["status"] == "Saved." and out["pending"] is None
    assert out["places"] == ["1", "2", "3"]
    assert out["conflictShown"] and out["staleStatus"] == "Not saved: item 1 was saved in another tab or window since."
    assert out["sentWhileConflict"] == 0
    assert out["overwrite"] == [7] and not out["conflictAfter"]
