"""`rlt2t annotate ...` run as a user runs it: subprocesses, a real pty for Ctrl-C, a live policy server."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from rlt2t.common.checkpoint import save_checkpoint
from rlt2t.common.config import load_config
from rlt2t.services import policy_app
from rlt2t.services.annotation.items import read_candidates
from rlt2t.services.annotation.store import Store

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
ENV.pop("RLT2T_API_TOKEN", None)


def rlt2t(*args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "rlt2t.cli", "annotate", *args], input=stdin, capture_output=True,
                          text=True, env=ENV, cwd=REPO, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"rlt2t annotate {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture
def run(tmp_path) -> Path:
    (tmp_path / "cands.jsonl").write_text("\n".join(json.dumps(row) for row in [
        {"id": "a", "source": "12 7 33", "candidates": ["4 5", "4 6", "9", "4 5"]},
        {"id": "b", "source": "8 8", "candidates": ["1", "2"]},
    ]) + "\n")
    return tmp_path


def loaded(run: Path) -> Path:
    """The run's default database holding the candidates file (in-process: the CLI's `load` is tested above)."""
    store = Store.open(f"sqlite:///{run}/annotate/annotations.db")
    try:
        store.add_items(list(read_candidates(run / "cands.jsonl", max_candidates=16, max_chars=1000)))
    finally:
        store.close()
    return run


def test_users_load_serve_rank_export_agreement(run):
    over = f"run.dir={run}"
    boss = rlt2t("add-user", "boss", "--admin", over).stdout.strip()
    rlt2t("add-user", "ann", "--token-file", str(run / "ann.token"), over)
    assert oct((run / "ann.token").stat().st_mode & 0o777) == "0o600"
    ann = (run / "ann.token").read_text().strip()
    assert "2 items added from" in rlt2t("load", "--candidates", str(run / "cands.jsonl"), over).stdout

    server = subprocess.Popen([sys.executable, "-m", "rlt2t.cli", "annotate", "serve", "--port", "0", over],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=REPO)
    try:
        line = server.stdout.readline()
        assert line.startswith("serving annotation on http://127.0.0.1:"), line + server.stderr.read()
        url = line.split(" on ")[1].strip()
        with httpx.Client(base_url=url, timeout=30) as client:
            for who, token in (("ann", ann), ("boss", boss)):
                h = {"Authorization": f"Bearer {token}"}
                item = client.get("/api/next", headers=h).json()["item"]
                assert item["source"] == "12 7 33" and len(item["candidates"]) == 3  # the duplicate merged
                by_text = {c["text"]: c["id"] for c in item["candidates"]}
                order = [by_text[t] for t in (["9", "4 6", "4 5"] if who == "ann" else ["9", "4 5", "4 6"])]
                sent = client.post("/api/submissions", headers=h, json={
                    "submission_id": f"{who}-submission", "item_id": item["item_id"], "action": "rank", "order": order})
                assert sent.status_code == 200, sent.text
        server.send_signal(signal.SIGTERM)
        assert server.wait(30) == 0
    finally:
        if server.poll() is None:
            server.kill()

    printed = rlt2t("export", "--out", str(run / "export"), over).stdout
    assert f"{run / 'export' / 'ranks.tsv'}: 2 rank lists" in printed
    assert (run / "export" / "ranks.tsv").read_text() == "12 7 33\t9\t4 6\t4 5\n12 7 33\t9\t4 5\t4 6\n"
    assert len((run / "export" / "pairs.jsonl").read_text().splitlines()) == 6
    assert (run / "export" / "ratings.jsonl").read_text() == ""
    assert (run / "annotate" / "annotations.db").is_file()  # the default database: SQLite in the run directory
    # ann and boss agree on 1 of 3 pairs: C = 2, D = 1 -> τ = 1/3.
    assert "ann / boss: mean τ +0.3333 over 1 items" in rlt2t("agreement", over).stdout


def test_terminal_with_scripted_stdin(run):
    over = f"run.dir={loaded(run)}"
    proc = rlt2t("terminal", "--annotator", "tom", over, "annotate.shuffle_candidates=false",
                 stdin="good\n-3\n1.5\n\n-2.0\n")
    out = proc.stdout
    assert "prompt>>> 12 7 33\nresult>>> 4 5\nReward (-2.0 ~ 2.0): " in out
    assert out.count("please enter a number from -2.0 to 2.0 (q to stop)") == 3  # "good", "-3", ""
    assert "annotate: 2 ratings stored this run; tom: done 0, left 2" in out  # input ended: stopped, nothing lost
    store = Store.open(f"sqlite:///{run}/annotate/annotations.db")
    try:
        tom = store.annotator_by_name("tom")
        ratings = store.annotation_of(tom, store.next_item(tom).id)
        assert (ratings.status, sorted(ratings.ratings.values())) == ("partial", [-2.0, 1.5])
    finally:
        store.close()


def _read_until(fd: int, text: str, seen: bytearray, start: int = 0, timeout: float = 120) -> int:
    """Read the terminal into ``seen`` until ``text`` shows after offset ``start``; returns where it ends."""
    deadline = time.monotonic() + timeout
    while text.encode() not in seen[start:]:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise AssertionError(f"no {text!r} within {timeout} s; "
                                 f"the terminal shows:\n{seen.decode(errors='replace')}")
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the child closed the terminal
            chunk = b""
        if not chunk:
            raise AssertionError(f"terminal closed before {text!r}:\n{seen.decode(errors='replace')}")
        seen.extend(chunk)
    return seen.index(text.encode(), start) + len(text)


def _wait_for_terminal_read(pid: int, timeout: float = 120) -> None:
    """Until the process sleeps reading its terminal. Ctrl-C sent earlier, between the prompt and the read, would
    be taken by Python's handler before readline waits on the terminal, and only acted on at the next key: a
    person never types that fast, a test does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        wchan = Path(f"/proc/{pid}/wchan").read_text()
        if state == "S" and any(w in wchan for w in ("select", "poll", "tty", "wait_woken")):
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} did not wait for the terminal within {timeout} s")


def _reap(pid: int, timeout: float = 60) -> int:
    """The child's exit code; killed (and the test failed by the caller) if it has not exited in time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return -signal.SIGKILL


def test_terminal_ctrl_c_in_a_real_terminal_keeps_the_answers(run):
    over = f"run.dir={loaded(run)}"
    pid, fd = pty.fork()
    if pid == 0:  # the child: a session leader whose controlling terminal is the pty
        # A shell starts background jobs with SIGINT ignored, and exec keeps that: Python then installs no
        # handler and Ctrl-C does nothing. A person's terminal session has the default; so does the child.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.chdir(REPO)
        os.execve(sys.executable, [sys.executable, "-m", "rlt2t.cli", "annotate", "terminal", "--annotator", "kim",
                                   over], ENV)
    seen = bytearray()
    code = None
    try:
        _read_until(fd, "Reward (-2.0 ~ 2.0): ", seen)
        os.write(fd, b"1.25\r")
        second = _read_until(fd, "result 2 of 3", seen)
        prompt = _read_until(fd, "Reward (-2.0 ~ 2.0): ", seen, start=second)
        _wait_for_terminal_read(pid)
        os.write(fd, b"0.5")  # typed, Enter not pressed ...
        # ... and shown (readline echoes what it has read) before Ctrl-C, as a person sees it: Ctrl-C makes the
        # line discipline flush unread input, and a readline woken for keys that were flushed waits for the next.
        _read_until(fd, "0.5", seen, start=prompt)
        _wait_for_terminal_read(pid)
        os.write(fd, b"\x03")  # ... then Ctrl-C: the terminal's line discipline sends SIGINT
        _read_until(fd, "ratings stored this run", seen)
    finally:
        code = _reap(pid)
        os.close(fd)
    assert code == 0, seen.decode(errors="replace")
    assert "annotate: 1 ratings stored this run; kim: done 0, left 2" in seen.decode()
    store = Store.open(f"sqlite:///{run}/annotate/annotations.db")
    try:
        kim = store.annotator_by_name("kim")
        assert list(store.annotation_of(kim, store.next_item(kim).id).ratings.values()) == [1.25]
    finally:
        store.close()


def test_items_sampled_on_a_live_policy_server(run, tiny_policy, live_server):
    root = run / "checkpoints"
    save_checkpoint(root, "epoch-0001", model=tiny_policy.model, tokenizer=tiny_policy.tokenizer, step=1,
                    meta={"policy_version": 0})
    (run / "sources.jsonl").write_text("".join(json.dumps({"id": f"s{i}", "source": f"{i + 11} {i + 12} 13"}) + "\n"
                                               for i in range(5)))
    cfg = load_config([], [f"run.dir={run}", "model.preset=tiny"])
    with live_server(policy_app.create_app(cfg, checkpoint_dir=root)) as policy:
        def load(limit: int) -> str:
            return rlt2t("load", "--sources", str(run / "sources.jsonl"), "--policy-url", policy.url, "--limit",
                         str(limit), f"run.dir={run}", "annotate.num_candidates=3", "annotate.max_new_tokens=6").stdout

        out = load(4)
        assert "4 items added" in out
        again = load(4)  # the same file again: --limit counts the sources not queued yet (one is left)
    assert "4 sources of" in again and "already have items of policy version 0: not sampled again" in again
    assert "1 items added" in again and "5 in all" in again
    store = Store.open(f"sqlite:///{run}/annotate/annotations.db")
    try:
        items = [store.item(i) for i in range(1, 5)]
    finally:
        store.close()
    assert [i.source for i in items] == [f"{k + 11} {k + 12} 13" for k in range(4)]
    assert [i.ext_id for i in items] == ["s0", "s1", "s2", "s3"]
    assert all(1 <= len(i.candidates) <= 3 and f"{policy.url} policy version 0" == i.origin for i in items)
