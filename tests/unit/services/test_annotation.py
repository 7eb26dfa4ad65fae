"""Annotation pieces without a server: Kendall τ, candidates files, the terminal loop, and the app through
FastAPI's TestClient (auth, CSRF, limits, errors, exports) on a SQLite file."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from rlt2t.common.config import load_config
from rlt2t.common.data import DataError
from rlt2t.services.annotation import export
from rlt2t.services.annotation.agreement import agreement, kendall_tau_b
from rlt2t.services.annotation.app import LOGIN_CSRF_COOKIE, SESSION_COOKIE, create_app
from rlt2t.services.annotation.items import read_candidates
from rlt2t.services.annotation.scripted import rank_by_score
from rlt2t.services.annotation.store import NewItem, Store, StoreError, Submission
from rlt2t.services.annotation.terminal import run_terminal

# --- Kendall's τ-b and agreement ---------------------------------------------------------------------------


def test_kendall_tau_b_against_hand_values():
    assert kendall_tau_b([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert kendall_tau_b([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    # 6 pairs: (1,2) and (3,4) swapped, 4 concordant: (4 - 2) / 6.
    assert kendall_tau_b([1, 2, 3, 4], [2, 1, 4, 3]) == pytest.approx(1 / 3)
    # One tie in x: C = 5, D = 0, n0 = 6, n1 = 1, n2 = 0 -> 5 / sqrt(5 * 6).
    assert kendall_tau_b([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(5 / math.sqrt(30))
    # SciPy's documented kendalltau example (tau-b with ties on both sides).
    assert kendall_tau_b([12, 2, 1, 12, 2], [1, 4, 7, 1, 0]) == pytest.approx(-0.47140452079103173)
    assert kendall_tau_b([1, 1, 1], [1, 2, 3]) is None and kendall_tau_b([1], [1]) is None


def test_agreement_averages_per_pair_over_shared_items():
    judgements = {
        1: {"a": {1: 0, 2: -1, 3: -2}, "b": {1: 0, 2: -1, 3: -2}, "c": {1: -2, 2: -1, 3: 0}},  # a=b, c reversed
        2: {"a": {4: 1.0, 5: 0.0}, "b": {4: 0.0, 5: 1.0}},  # a vs b: -1
        3: {"a": {6: 1.0, 7: 1.0}, "c": {6: 0, 7: -1}},  # a constant: undefined
        4: {"b": {8: 0, 9: -1}},  # nobody to compare with
    }
    report = agreement(judgements)
    by_pair = {(p.annotator_a, p.annotator_b): p for p in report.pairs}
    assert (by_pair["a", "b"].items, by_pair["a", "b"].mean_tau) == (2, 0.0)
    assert (by_pair["a", "c"].items, by_pair["a", "c"].mean_tau, by_pair["a", "c"].undefined) == (1, -1.0, 1)
    assert (by_pair["b", "c"].items, by_pair["b", "c"].mean_tau) == (1, -1.0)
    assert report.comparisons == 4 and report.mean_tau == pytest.approx((1 - 1 - 1 - 1) / 4)


# --- candidates files ---------------------------------------------------------------------------------------


def test_read_candidates_accepts_strings_objects_and_predict_output(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join([
        json.dumps({"id": 7, "source": "s1", "candidates": ["a", "b", "a"]}),
        "",
        json.dumps({"source": "s2", "candidates": [{"text": "x", "rerank_score": 1.0}, {"text": "y"}],
                    "prediction": "x", "chosen": 0}),
    ]).encode())
    got = list(read_candidates(path, max_candidates=4, max_chars=100))
    assert [(g.source, g.candidates, g.ext_id) for g in got] == [("s1", ("a", "b"), "7"), ("s2", ("x", "y"), None)]


@pytest.mark.parametrize("line, where", [
    ('{"source": "s", "candidates": ["a"]', "3: not valid JSON"),
    ('{"candidates": ["a"]}', "3: field 'source': missing or empty"),
    ('{"source": "s", "candidates": "a"}', "3: field 'candidates': expected a list, got str"),
    ('{"source": "s", "candidates": [1]}', "3: field 'candidates': candidate 0: expected a string"),
    ('{"source": "s", "candidates": []}', "3: field 'candidates': empty list"),
    ('{"source": "s", "candidates": ["1", "2", "3", "4", "5"]}', "3: field 'candidates': 5 distinct candidates"),
    ('{"source": "s", "candidates": ["' + "x" * 101 + '"]}', "3: field 'candidates': longer than 100"),
    (r'{"source": "bad \ud800", "candidates": ["a", "b"]}', "3: field 'source': not encodable as UTF-8"),
    (r'{"source": "s", "candidates": ["a", {"text": "\udfff b"}]}',
     "3: field 'candidates': candidate 1: not encodable as UTF-8"),
    (r'{"id": "\ud800", "source": "s", "candidates": ["a"]}', "3: field 'id': not encodable as UTF-8"),
])
def test_read_candidates_names_file_line_and_field(tmp_path, line, where):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"source": "ok", "candidates": ["a"]}\n\n' + line + "\n")
    with pytest.raises(DataError) as e:
        list(read_candidates(path, max_candidates=4, max_chars=100))
    assert str(e.value).startswith(f"{path}:{where}")


def test_a_scripted_annotator_ranks_by_its_score_and_exports_like_people(tmp_path):
    store = Store.open(f"sqlite:///{tmp_path}/s.db")
    try:
        store.add_items([NewItem("s1", ("a b c", "a", "a b"), "t"), NewItem("s2", ("x y", "z"), "t")])
        store.add_annotator("bot")
        bot = store.annotator_by_name("bot")
        assert rank_by_score(store, bot, lambda source, cand: -len(cand.split()), limit=1) == 1
        assert rank_by_score(store, bot, lambda source, cand: -len(cand.split())) == 1
        assert store.progress(bot).left == 0
        lines = "".join(export.rank_tsv_lines(export.rank_lists(store)))
    finally:
        store.close()
    assert lines == "s1\ta\ta b\ta b c\ns2\tz\tx y\n"


# --- the terminal loop --------------------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path):
    s = Store.open(f"sqlite:///{tmp_path}/a.db")
    s.add_items([NewItem("prompt one", ("r1", "r2"), "t"), NewItem("prompt two", ("r3",), "t")])
    s.add_annotator("tom")
    yield s
    s.close()


def scripted(answers: list[str | BaseException]):
    """A `read` that answers from a list, recording prompts; an exception in the list is raised there."""
    prompts: list[str] = []

    def read(prompt: str) -> str:
        prompts.append(prompt)
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    return read, prompts


def test_items_and_annotators_are_added_once(store):
    assert store.add_items([NewItem("prompt one", ("r1", "r2"), "elsewhere"), NewItem("new", ("n",), "t")]) == (1, 1)
    with pytest.raises(StoreError, match=r"annotator 'tom' exists already \(a new token for them: `rlt2t annotate "
                                         r"add-user tom --reset`\)"):
        store.add_annotator("tom")
    with pytest.raises(StoreError, match="no spaces"):
        store.add_annotator("two words")


def test_terminal_validates_stores_each_answer_and_resumes(store):
    tom = store.annotator_by_name("tom")
    lines: list[str] = []
    read, prompts = scripted(["great", "2.5", "nan", " 1.5 ", "q"])
    result = run_terminal(store, tom, rating_range=(-2.0, 2.0), shuffle=False, read=read, write=lines.append)
    assert (result.rated, result.finished) == (1, False)
    assert prompts == ["Reward (-2.0 ~ 2.0): "] * 5
    assert lines[:3] == ["[Step 1]  item 1 · result 1 of 2 · done 0, left 2", "prompt>>> prompt one", "result>>> r1"]
    assert lines.count("please enter a number from -2.0 to 2.0 (q to stop)") == 3
    item = store.item(1)
    assert store.annotation_of(tom, 1).ratings == {item.candidates[0].id: 1.5}

    # Ctrl-C at the next prompt: what was entered stays; the next run resumes with the unrated result.
    read, _ = scripted(["-2", KeyboardInterrupt()])
    lines.clear()
    assert run_terminal(store, tom, rating_range=(-2.0, 2.0), shuffle=False, read=read, write=lines.append).rated == 1
    assert "result>>> r2" in lines and store.annotation_of(tom, 1).status == "rated"
    read, _ = scripted(["0"])
    lines.clear()
    result = run_terminal(store, tom, rating_range=(-2.0, 2.0), shuffle=False, read=read, write=lines.append)
    assert (result.rated, result.finished, lines[-1]) == (1, True, "nothing left to rate")
    assert "prompt>>> prompt two" in lines and store.progress(tom).left == 0
    store.add_items([NewItem("prompt three", ("r4",), "t")])
    read, _ = scripted([EOFError()])  # Ctrl-D at the prompt: stop, nothing stored
    result = run_terminal(store, tom, rating_range=(-2.0, 2.0), read=read, write=lines.append)
    assert (result.rated, result.finished, store.progress(tom).left) == (0, False, 1)


# --- the app ------------------------------------------------------------------------------------------------


@pytest.fixture
def app_env(tmp_path):
    cfg = load_config([], [f"run.dir={tmp_path}", "annotate.max_body_bytes=2048", "annotate.shuffle_candidates=false"])
    store = Store.open(f"sqlite:///{tmp_path}/app.db")
    store.add_items([NewItem("s1", ("a", "b", "c"), "t"), NewItem("s2", ("d", "e"), "t")])
    tokens = {"ann": store.add_annotator("ann"), "other": store.add_annotator("other"),
              "boss": store.add_annotator("boss", "admin")}
    client = TestClient(create_app(cfg, store), base_url="http://127.0.0.1")
    yield client, store, tokens
    client.close()
    store.close()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_login_sets_a_session_and_writes_need_the_csrf_token(app_env):
    client, store, tokens = app_env
    assert client.get("/", follow_redirects=False).headers["location"] == "/login?next=%2F"
    form = client.get("/login")
    login_csrf = client.cookies[LOGIN_CSRF_COOKIE]
    assert f'value="{login_csrf}"' in form.text
    body = {"name": "ann", "token": tokens["ann"], "next": "//evil.example/x"}
    assert client.post("/login", data={**body, "csrf": "forged"}, follow_redirects=False).status_code == 403
    # Each form served carries a new token (and cookie).
    assert client.cookies[LOGIN_CSRF_COOKIE] != login_csrf
    assert client.post("/login", data={**body, "token": "wrong", "csrf": client.cookies[LOGIN_CSRF_COOKIE]},
                       follow_redirects=False).status_code == 401
    ok = client.post("/login", data={**body, "csrf": client.cookies[LOGIN_CSRF_COOKIE]}, follow_redirects=False)
    assert ok.status_code == 303 and ok.headers["location"] == "/"  # never off-site
    cookie = ok.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=lax" in cookie and SESSION_COOKIE in client.cookies
    page = client.get("/")
    csrf = page.text.split('name="csrf-token" content="')[1].split('"')[0]
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert "<script>" not in page.text.replace('<script src="/static/annotate.js" defer></script>', "")
    sub = {"submission_id": "sess-000001", "item_id": 1, "action": "skip"}
    assert client.post("/api/submissions", json=sub).status_code == 403
    assert client.post("/api/submissions", json=sub, headers={"X-CSRF-Token": "x" + csrf}).status_code == 403
    done = client.post("/api/submissions", json=sub, headers={"X-CSRF-Token": csrf})
    assert done.status_code == 200 and done.json()["progress"] == {"done": 1, "left": 1, "skipped": 1, "flagged": 0}
    assert client.post("/logout", data={"csrf": "nope"}).status_code == 403
    assert client.post("/logout", data={"csrf": csrf}, follow_redirects=False).status_code == 303
    assert client.get("/api/me").status_code == 401


def test_api_errors_name_the_field(app_env):
    client, store, tokens = app_env
    h = bearer(tokens["ann"])
    assert client.get("/api/me", headers=bearer("nope")).status_code == 401
    base = {"submission_id": "err-0000001", "item_id": 1}
    bad = client.post("/api/submissions", headers=h, json={**base, "action": "rank", "order": [1, 2]})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "order"]
    bad = client.post("/api/submissions", headers=h, json={**base, "action": "rate",
                                                          "ratings": [{"candidate_id": 1, "rating": 9}]})
    assert bad.status_code == 422 and "[-2.0, 2.0]" in bad.json()["detail"][0]["msg"]
    bad = client.post("/api/submissions", headers={**h, "Content-Type": "application/json"},
                      content=b'{"submission_id": "err-0000001", "item_id": 1, "action": "rate", '
                              b'"ratings": [{"candidate_id": 1, "rating": NaN}]}')
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"][:2] == ["body", "ratings"]
    assert client.post("/api/submissions", headers=h, json={**base, "submission_id": "short",
                                                            "action": "skip"}).status_code == 422
    assert client.post("/api/submissions", headers=h, json={**base, "item_id": 99, "action": "skip"}).status_code == 404
    huge = client.post("/api/submissions", headers=h, json={**base, "action": "skip", "note": "x" * 3000})
    assert huge.status_code == 413 and "annotate.max_body_bytes" in huge.json()["detail"]
    assert client.post("/api/submissions", headers=h, json={**base, "action": "skip"}).status_code == 200
    again = client.post("/api/submissions", headers=h, json={**base, "action": "skip"})
    assert again.status_code == 200 and again.json()["duplicate"] is True
    flagged = client.post("/api/submissions", headers=h, json={**base, "action": "skip", "flagged": True})
    assert flagged.status_code == 409


def test_own_work_only_and_admin_exports(app_env):
    client, store, tokens = app_env
    ann, other, boss = bearer(tokens["ann"]), bearer(tokens["other"]), bearer(tokens["boss"])
    item = client.get("/api/next", headers=ann).json()["item"]
    order = [c["id"] for c in reversed(item["candidates"])]
    mine = client.post("/api/submissions", headers=ann,
                       json={"submission_id": "own-0000001", "item_id": item["item_id"], "action": "rank",
                             "order": order}).json()["annotation"]
    assert client.get(f"/api/annotations/{mine['annotation_id']}", headers=ann).json()["order"] == order
    assert client.get(f"/api/annotations/{mine['annotation_id']}", headers=other).status_code == 404
    assert client.get(f"/api/items/{item['item_id']}", headers=other).json()["annotation"] is None
    assert client.get("/api/annotations", headers=other).json()["total"] == 0
    assert client.get("/api/annotations", headers=boss).json()["total"] == 1
    for path in ("/api/admin/summary", "/api/admin/export/ranks.tsv", "/metrics", "/readyz"):
        assert client.get(path, headers=ann).status_code == 403, path
    assert client.get("/api/admin/export/ranks.tsv", headers=boss).text == "s1\tc\tb\ta\n"
    pairs = [json.loads(x) for x in client.get("/api/admin/export/pairs.jsonl", headers=boss).text.splitlines()]
    assert pairs == list(export.pair_rows([("s1", ["c", "b", "a"])]))
    assert client.get("/api/admin/export/nope.csv", headers=boss).status_code == 404
    other_rank = list(reversed(order))
    store.submit(store.annotator_by_name("other"), Submission("oth-0000001", item["item_id"], "rank",
                                                              order=tuple(other_rank)))
    summary = client.get("/api/admin/summary", headers=boss).json()
    assert summary["agreement"] == [{"annotator_a": "ann", "annotator_b": "other", "items": 1, "mean_tau": -1.0,
                                     "undefined": 0}]
    assert 'rlt2t_annotate_requests_total{route="/api/admin/summary",status="200"}' in \
        client.get("/metrics", headers=boss).text


def test_pages_escape_what_they_show(app_env, tmp_path: Path):
    client, store, tokens = app_env
    store.add_items([NewItem("<script>alert(1)</script>", ("<b>x</b>", "y"), "t")])
    boss = store.annotator_by_name("boss")
    item_id = store.count_items()
    store.submit(boss, Submission("xss-0000001", item_id, "skip", flagged=True, note="<img src=x onerror=alert(2)>"))
    client.get("/login")
    client.post("/login", data={"name": "boss", "token": tokens["boss"], "csrf": client.cookies[LOGIN_CSRF_COOKIE]})
    admin = client.get("/admin").text
    history = client.get("/history").text
    for page in (admin, history):
        assert "<script>alert(1)</script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<img src=x" not in admin and "&lt;img src=x onerror=alert(2)&gt;" in admin
