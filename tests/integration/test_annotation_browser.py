"""The annotation web app in a real headless Chromium (Debian's /usr/bin/chromium driven by Playwright; Playwright
never downloads a browser here). Screenshots of every step go to each test's tmp_path.

One app and one browser serve the module; each test opens a fresh browser context (its own cookies and
localStorage), as a new person on a new machine would. The browser is module-scoped, not session-scoped, on
purpose: Playwright's sync API keeps an event loop marked running on the main thread until it stops, which
would break any later test calling asyncio.run.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from sqlalchemy import select

from rlt2t.common.config import load_config
from rlt2t.services.annotation.app import create_app
from rlt2t.services.annotation.store import NewItem, Store
from rlt2t.services.annotation.tables import submissions

pytestmark = [pytest.mark.integration, pytest.mark.system_package("chromium")]

CHROMIUM = os.environ.get("RLT2T_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')")
expect = sync_api.expect
INJECTED = ["<script>window.__pwned = 1</script>", '<img src="x" onerror="window.__pwned = 2">',
            "plain & <b>bold</b> text", ""]


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium (Playwright launches it with a fresh temporary --user-data-dir)."""
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


class Site:
    def __init__(self, url: str, store: Store, tokens: dict[str, str], item_ids: list[int]) -> None:
        self.url, self.store, self.tokens, self.item_ids = url, store, tokens, item_ids


@pytest.fixture(scope="module")
def site(tmp_path_factory, live_server):
    """The app on a loopback port: 3 items of 4 candidates, one item of injected markup; annotators, each test
    its own, and an admin."""
    root = tmp_path_factory.mktemp("annotate-site")
    cfg = load_config([], [f"run.dir={root}"])
    store = Store.open(f"sqlite:///{root}/annotations.db")
    store.add_items([NewItem(f"source {i}: describe the finding", tuple(f"candidate {i}.{k}" for k in range(4)), "test")
                     for i in range(3)] + [NewItem("<script>window.__pwned = 3</script>", tuple(INJECTED), "test")])
    tokens = {name: store.add_annotator(name, "admin" if name == "boss" else "annotator")
              for name in ("alice", "bob", "carol", "dave", "erin", "fay", "gus", "hal", "boss")}
    ids = [store.next_item(store.annotator_by_name("alice")).id + k for k in range(4)]
    with live_server(create_app(cfg, store)) as server:
        yield Site(server.url, store, tokens, ids)
    store.close()


@pytest.fixture
def page_of(browser, site, tmp_path):
    """page_of(name): a logged-in page of a fresh context; shots(page, label) saves a screenshot."""
    contexts = []

    def open_page(name: str | None = None, url: str | None = None, bypass_csp: bool = False):
        context = browser.new_context(viewport={"width": 1100, "height": 800}, bypass_csp=bypass_csp)
        contexts.append(context)
        page = context.new_page()
        page.set_default_timeout(10_000)
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("dialog", lambda d: errors.append(f"dialog: {d.message}"))
        page.js_errors = errors
        if name is not None:
            login(page, url or site.url, name, site.tokens[name])
        return page

    yield open_page
    for context in contexts:
        context.close()


def login(page, base: str, name: str, token: str) -> None:
    page.goto(base + "/")
    page.wait_for_url("**/login?next=%2F")
    page.fill("input[name=name]", name)
    page.fill("input[name=token]", token)
    page.click("button[type=submit]")
    page.wait_for_url(base + "/")


def shot(page, tmp_path: Path, label: str) -> None:
    page.screenshot(path=str(tmp_path / f"{label}.png"), full_page=True)


def order(page) -> list[int]:
    return [int(x) for x in page.locator("#candidates li").evaluate_all("els => els.map(e => e.dataset.id)")]


def shown_item(page) -> int:
    return int(page.locator("#item-label").inner_text().split()[-1])


def test_login_rank_by_keyboard_and_drag_reload_resume(page_of, site, tmp_path):
    page = page_of()
    page.goto(site.url + "/")
    page.fill("input[name=name]", "alice")
    page.fill("input[name=token]", "not-the-token")
    page.click("button[type=submit]")
    assert page.locator(".error").inner_text() == "Unknown name or token."
    shot(page, tmp_path, "01-login-refused")
    page.fill("input[name=name]", "alice")
    page.fill("input[name=token]", site.tokens["alice"])
    page.click("button[type=submit]")
    page.wait_for_url(site.url + "/")
    expect(page.locator("#progress")).to_have_text(re.compile("^done 0"))
    assert page.locator("#progress").inner_text() == "done 0 · left 4"
    first = shown_item(page)
    assert first == site.item_ids[0]

    # Keyboard: the first candidate has the focus. "4" sends it to the last place, ↑ selects the one above it,
    # Shift+↑ twice carries that one to the top.
    a, b, c, d = order(page)
    for key in ("4", "ArrowUp", "Shift+ArrowUp", "Shift+ArrowUp"):
        page.keyboard.press(key)
    assert order(page) == [d, b, c, a]
    shot(page, tmp_path, "02-ranked-by-keyboard")
    page.keyboard.press("Enter")
    expect(page.locator("#progress")).to_have_text(re.compile("^done 1"))
    alice = site.store.annotator_by_name("alice")
    assert site.store.annotation_of(alice, first).order == (d, b, c, a)

    # Drag: the last candidate's handle dropped on the top half of the first.
    second = site.item_ids[1]
    expect(page.locator("#item-label")).to_have_text(f"item {second}")
    a, b, c, d = order(page)
    handle = page.locator(f"#candidates li[data-id='{d}'] .handle").bounding_box()
    target = page.locator(f"#candidates li[data-id='{a}']").bounding_box()
    page.mouse.move(handle["x"] + handle["width"] / 2, handle["y"] + handle["height"] / 2)
    page.mouse.down()
    page.mouse.move(target["x"] + 40, target["y"] + 4, steps=8)
    page.mouse.up()
    assert order(page) == [d, a, b, c]
    shot(page, tmp_path, "03-dragged")

    # Reload before submitting: the same item comes back in the order left, with the progress so far.
    page.reload()
    page.wait_for_selector("#candidates li")
    assert shown_item(page) == second and order(page) == [d, a, b, c]
    assert page.locator("#progress").inner_text() == "done 1 · left 3"
    shot(page, tmp_path, "04-reloaded-resumed")
    page.click("#submit")
    expect(page.locator("#progress")).to_have_text(re.compile("^done 2"))
    assert site.store.annotation_of(alice, second).order == (d, a, b, c)

    # The answer to a submission is lost after the server committed it: the page keeps the submission and
    # resends it under the same id when it reloads; the server applies it once.
    third = site.item_ids[2]
    expect(page.locator("#item-label")).to_have_text(f"item {third}")
    dropped = []

    def drop_answer(route):
        route.fetch()  # reaches the server, which commits
        dropped.append(route.request.post_data_json["submission_id"])
        route.abort()

    page.route("**/api/submissions", drop_answer)
    page.keyboard.press("Enter")
    expect(page.locator("#status")).to_have_text(re.compile("^Not saved yet"))
    shot(page, tmp_path, "05-answer-lost")
    page.unroute("**/api/submissions")
    assert site.store.annotation_of(alice, third) is not None
    page.reload()
    expect(page.locator("#status")).to_have_text("Already saved.")
    assert page.locator("#progress").inner_text() == "done 3 · left 1"
    assert page.evaluate("localStorage.length") == 0
    records, total = site.store.annotations(alice)
    assert total == 3 and sum(r.item_id == third for r in records) == 1
    with site.store.read() as conn:
        sent = conn.execute(select(submissions.c.id).where(submissions.c.item_id == third)).scalars().all()
    assert sent == dropped  # one submission, under the id the page generated before the answer was lost
    assert not page.js_errors


def test_second_annotator_cannot_read_the_firsts_work(page_of, site, tmp_path):
    alice = site.store.annotator_by_name("alice")
    ranked = site.store.annotations(alice)[0]
    assert ranked, "needs alice's work from the previous test"
    page = page_of("bob")
    page.wait_for_selector("#candidates li")
    # Bob's queue starts at the first item, without alice's ranking (his own display order, nothing "before").
    assert shown_item(page) == site.item_ids[0]
    assert page.locator("#status").inner_text() == ""
    answer = page.evaluate("""async (id) => {
        const one = await fetch(`/api/annotations/${id}`);
        const all = await (await fetch('/api/annotations')).json();
        const admin = await fetch('/api/admin/summary');
        const forged = await fetch('/api/submissions', {method: 'POST', headers: {'Content-Type': 'application/json'},
            body: JSON.stringify({submission_id: 'forged-0001', item_id: 1, action: 'skip'})});
        return [one.status, all.total, admin.status, forged.status];
    }""", ranked[0].id)
    assert answer == [404, 0, 403, 403]  # the last: a cookie-authenticated write without the CSRF header
    page.goto(site.url + f"/items/{ranked[0].item_id}")
    page.wait_for_selector("#candidates li")
    assert page.locator("#status").inner_text() == ""  # bob sees the item, never alice's annotation of it
    page.goto(site.url + "/admin")
    assert "This page is for admins." in page.content()
    page.goto(site.url + "/history")
    assert page.locator("main p").first.inner_text() == "0 in all."
    shot(page, tmp_path, "bob-history")
    assert not page.js_errors


def test_injected_markup_renders_as_text(page_of, site, tmp_path):
    # The Content-Security-Policy would stop an injected inline script anyway: switched off here, so that the
    # escaping alone is what is tested.
    page = page_of("carol", bypass_csp=True)
    page.goto(site.url + f"/items/{site.item_ids[3]}")
    page.wait_for_selector("#candidates li")
    assert page.locator("#source").inner_text() == "<script>window.__pwned = 3</script>"
    texts = page.locator("#candidates li .text").all_text_contents()
    assert sorted(texts) == sorted(INJECTED)
    assert page.locator("#candidates img, #candidates script, #candidates b").count() == 0
    assert page.evaluate("window.__pwned") is None
    shot(page, tmp_path, "injected-as-text")
    page.keyboard.press("f")
    page.fill("#note", "<i>broken</i> item")
    page.click("#skip")
    expect(page.locator("#status")).to_have_text("Saved.")

    admin = page_of("boss", bypass_csp=True)
    admin.goto(site.url + "/admin")
    flagged = admin.locator("#flagged tbody")
    assert "<script>window.__pwned = 3</script>" in flagged.inner_text()
    assert "<i>broken</i> item" in flagged.inner_text()
    assert admin.locator("#flagged script, #flagged i").count() == 0
    assert admin.evaluate("window.__pwned") is None
    shot(admin, tmp_path, "admin-view")
    assert not page.js_errors and not admin.js_errors


def test_rating_on_a_scale(page_of, site, tmp_path, live_server):
    cfg = load_config([], [f"run.dir={tmp_path}", "annotate.mode=rate", "annotate.rating_step=0.5"])
    with live_server(create_app(cfg, site.store)) as rating_site:
        page = page_of("dave", rating_site.url)
        page.wait_for_selector("#candidates li input[type=range]")
        item = shown_item(page)
        ids = order(page)
        assert page.locator("#candidates .place").count() == 0  # places are a ranking's
        page.keyboard.press("Enter")  # not every candidate rated yet: refused in the page
        assert page.locator("#status").inner_text() == "Rate every candidate first (or skip the item)."
        for k, li in enumerate(page.locator("#candidates li").all()):
            li.focus()
            for _ in range(k + 1):  # from the middle (0.0): +0.5 per step
                page.keyboard.press("ArrowRight")
        shot(page, tmp_path, "rated")
        page.keyboard.press("Enter")
        expect(page.locator("#progress")).to_have_text(re.compile("^done 1"))
    dave = site.store.annotator_by_name("dave")
    assert site.store.annotation_of(dave, item).ratings == {cid: 0.5 * (k + 1) for k, cid in enumerate(ids)}
    assert not page.js_errors


def focused_id(page) -> str:
    return page.evaluate("document.activeElement.id || document.activeElement.tagName")


def test_enter_submits_after_flag_or_skip_was_clicked(page_of, site, tmp_path):
    page = page_of("erin")
    page.wait_for_selector("#candidates li")
    erin = site.store.annotator_by_name("erin")
    first, ids = shown_item(page), order(page)
    page.click("#flag")  # with the mouse: the button must not keep the focus
    expect(page.locator("#flag")).to_have_attribute("aria-pressed", "true")
    expect(page.locator("#note-box")).to_be_visible()
    assert focused_id(page) != "flag"
    shot(page, tmp_path, "flag-clicked")
    page.keyboard.press("Enter")  # submits (a focused Flag would have been un-flagged instead)
    expect(page.locator("#progress")).to_have_text(re.compile("^done 1"))
    mine = site.store.annotation_of(erin, first)
    assert (mine.status, mine.flagged, mine.order) == ("ranked", True, tuple(ids))

    # Flag clicked twice (on, then off again), then Enter: one submission, unflagged.
    second = site.item_ids[1]
    expect(page.locator("#item-label")).to_have_text(f"item {second}")
    page.click("#flag")
    page.click("#flag")
    expect(page.locator("#flag")).to_have_attribute("aria-pressed", "false")
    page.keyboard.press("Enter")
    expect(page.locator("#progress")).to_have_text(re.compile("^done 2"))
    assert site.store.annotation_of(erin, second).flagged is False

    # Reached with Tab, Flag still lets Enter submit; Space presses it.
    third = site.item_ids[2]
    expect(page.locator("#item-label")).to_have_text(f"item {third}")
    page.focus("#flag")
    page.keyboard.press("Space")
    expect(page.locator("#flag")).to_have_attribute("aria-pressed", "true")
    page.focus("#flag")
    page.keyboard.press("Enter")
    expect(page.locator("#progress")).to_have_text(re.compile("^done 3"))
    assert site.store.annotation_of(erin, third).flagged is True

    # Skip clicked on an item's page, then Enter: the item is ranked (Enter did not press Skip again).
    page.goto(site.url + f"/items/{second}")
    page.wait_for_selector("#candidates li")
    with page.expect_response("**/api/submissions") as skipped:
        page.click("#skip")
    assert skipped.value.status == 200 and site.store.annotation_of(erin, second).status == "skipped"
    expect(page.locator("#task")).to_have_attribute("aria-busy", "false")  # the item is shown again
    expect(page.locator("#status")).to_have_text("Saved.")
    assert focused_id(page) != "skip"
    with page.expect_response("**/api/submissions") as ranked:
        page.keyboard.press("Enter")
    assert ranked.value.status == 200 and site.store.annotation_of(erin, second).status == "ranked"
    assert not page.js_errors


def test_place_numbers_follow_the_candidates(page_of, site, tmp_path):
    page = page_of("hal")
    page.wait_for_selector("#candidates li")
    places = page.locator("#candidates li .place")
    expect(places.first).to_be_visible()
    assert places.all_text_contents() == ["1", "2", "3", "4"]
    a, b, c, d = order(page)
    page.keyboard.press("3")  # the first candidate (focused) goes to place 3, the number shown beside it
    assert order(page) == [b, c, a, d]
    assert places.all_text_contents() == ["1", "2", "3", "4"]
    assert page.locator(f"#candidates li[data-id='{a}'] .place").inner_text() == "3"
    handle = page.locator(f"#candidates li[data-id='{d}'] .handle").bounding_box()
    target = page.locator(f"#candidates li[data-id='{b}']").bounding_box()
    page.mouse.move(handle["x"] + handle["width"] / 2, handle["y"] + handle["height"] / 2)
    page.mouse.down()
    page.mouse.move(target["x"] + 40, target["y"] + 4, steps=8)
    assert page.locator(f"#candidates li[data-id='{d}'] .place").inner_text() == "1"  # while it is dragged
    page.mouse.up()
    assert order(page) == [d, b, c, a] and places.all_text_contents() == ["1", "2", "3", "4"]
    shot(page, tmp_path, "places")
    assert not page.js_errors


def test_a_second_tab_is_told_before_it_can_overwrite_and_overwrites_only_when_asked(page_of, site, tmp_path):
    one = page_of("fay")
    one.wait_for_selector("#candidates li")
    two = one.context.new_page()  # the same browser: the tabs share the session and localStorage
    two.set_default_timeout(10_000)
    two.goto(site.url + "/")
    two.wait_for_selector("#candidates li")
    item = shown_item(one)
    assert shown_item(two) == item
    fay = site.store.annotator_by_name("fay")
    a, b, c, d = order(one)
    two.keyboard.press("4")  # tab two reorders (its own draft: tab one's screen does not change)
    mine = order(two)
    assert mine == [b, c, d, a] and order(one) == [a, b, c, d]
    one.keyboard.press("2")
    one.keyboard.press("Enter")
    expect(one.locator("#progress")).to_have_text(re.compile("^done 1"))
    assert site.store.annotation_of(fay, item).order == (b, a, c, d)

    # Tab two hears of it before it submits anything; Enter does not replace the save it has not seen.
    expect(two.locator("#conflict")).to_be_visible()
    expect(two.locator("#conflict-text")).to_contain_text("another tab or window")
    shot(two, tmp_path, "second-tab-told")
    two.keyboard.press("Enter")
    expect(two.locator("#status")).to_have_text(re.compile("^Not saved: this item was saved in another tab"))
    assert site.store.annotation_of(fay, item).order == (b, a, c, d)
    assert order(two) == mine  # its own order is still on screen

    # The explicit overwrite replaces it, and says so.
    two.click("#overwrite")
    expect(two.locator("#status")).to_have_text("Saved.")
    saved = site.store.annotation_of(fay, item)
    assert (saved.order, saved.revision) == (tuple(mine), 2)
    assert focused_id(two) != "overwrite"
    # And now tab one, still open, is the one told (its next item is another; reopening this one shows it).
    one.goto(site.url + f"/items/{item}")
    one.wait_for_selector("#candidates li")
    assert order(one) == mine and one.locator("#conflict").is_hidden()
    assert not one.js_errors


def test_another_machine_is_refused_with_409_and_can_load_the_saved_version(page_of, site, tmp_path):
    one, two = page_of("gus"), page_of("gus")  # two browsers: no message passes between them
    for page in (one, two):
        page.wait_for_selector("#candidates li")
    item = shown_item(one)
    assert shown_item(two) == item
    gus = site.store.annotator_by_name("gus")
    a, b, c, d = order(one)
    one.keyboard.press("4")
    one.keyboard.press("Enter")
    expect(one.locator("#progress")).to_have_text(re.compile("^done 1"))
    assert two.locator("#conflict").is_hidden()  # nothing told it yet

    two.keyboard.press("Enter")  # the server refuses: it was made against no annotation, and there is one now
    expect(two.locator("#status")).to_have_text(f"Not saved: item {item} was saved in another tab or window since.")
    expect(two.locator("#conflict")).to_be_visible()
    assert site.store.annotation_of(gus, item).order == (b, c, d, a)
    shot(two, tmp_path, "refused-409")

    two.click("#show-saved")
    expect(two.locator("#status")).to_have_text("This is the saved version.")
    assert order(two) == [b, c, d, a] and two.locator("#conflict").is_hidden()
    two.locator(f"#candidates li[data-id='{d}']").focus()
    two.keyboard.press("1")
    two.keyboard.press("Enter")  # built on the saved version now: accepted
    expect(two.locator("#progress")).to_have_text(re.compile("^done 1"))
    saved = site.store.annotation_of(gus, item)
    assert (saved.order, saved.revision) == ((d, b, c, a), 2)
    assert not one.js_errors and not two.js_errors
