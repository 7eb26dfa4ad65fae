// rlt2t annotation page: rank candidates (drag or keyboard) or rate them, skip, flag; no build step, no library.
// Texts only ever go into the page through textContent: a candidate holding markup shows as that markup.
// Every submission carries a client-generated id and stays in localStorage until the server acknowledged it,
// so a reload, a lost answer or a server restart neither loses nor duplicates it; an unsent ranking of the
// current item is kept as this tab's draft (sessionStorage), so a reload resumes where the annotator was.
// Each submission names the annotation's revision the page built on: when the same annotator saved the item in
// another tab or window meanwhile, the page says so (at once for a tab of this browser, else from the server's
// 409) and replaces that save only when asked to ("Overwrite").
"use strict";

(() => {
  const body = document.body;
  const csrf = document.querySelector('meta[name="csrf-token"]').content;
  const mode = body.dataset.mode;
  const fixedItem = body.dataset.itemId;
  const annotator = body.dataset.annotator;
  const ratingMin = Number(body.dataset.ratingMin);
  const ratingMax = Number(body.dataset.ratingMax);
  const ratingStep = Number(body.dataset.ratingStep);
  const pendingPrefix = "rlt2t.pending.";
  const pendingKey = (itemId) => `${pendingPrefix}${itemId}.${annotator}`;
  const legacyPendingKey = `rlt2t.pending.${annotator}`; // one key for every item, before revisions
  const draftKey = (itemId) => `rlt2t.draft.${annotator}.${itemId}`;
  const $ = (id) => document.getElementById(id);
  const list = $("candidates");
  // Other tabs of this annotator in this browser hear of each save at once (none where unsupported).
  const channel = typeof BroadcastChannel === "function" ? new BroadcastChannel(`rlt2t.saved.${annotator}`) : null;
  const pageId = newSubmissionId(); // whose pending submission is whose, between tabs
  let item = null;
  let baseRevision = 0; // the revision of this annotator's annotation that the screen builds on (0: none)
  let conflict = null; // the revision saved elsewhere since, while the page waits for the annotator's choice
  let flagged = false;
  let busy = false; // a submission, or showing the saved version, runs until the next screen is shown
  let dragging = null;
  let lastCandidate = null; // the candidate that last had the focus

  function newSubmissionId() {
    // crypto.randomUUID exists only in secure contexts; getRandomValues everywhere.
    const bytes = new Uint8Array(16);
    crypto.getRandomValues(bytes);
    return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  function describe(detail) {
    if (typeof detail === "string") return detail;
    if (Array.isArray(detail)) return detail.map((d) => `${(d.loc || []).join(".")}: ${d.msg}`).join("; ");
    return "";
  }

  async function api(method, path, payload) {
    const init = { method, credentials: "same-origin", headers: { Accept: "application/json" } };
    if (payload !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.headers["X-CSRF-Token"] = csrf;
      init.body = JSON.stringify(payload);
    }
    const response = await fetch(path, init);
    if (response.status === 401) {
      location.assign(`/login?next=${encodeURIComponent(location.pathname)}`);
      throw Object.assign(new Error("logged out"), { status: 401 });
    }
    const data = await response.json().catch(() => ({}));
    if (!response.ok) {
      throw Object.assign(new Error(describe(data.detail) || response.statusText), { status: response.status, data });
    }
    return data;
  }

  function setStatus(text, kind = "") {
    $("status").textContent = text;
    $("status").className = kind;
  }

  function showProgress(p) {
    $("progress").textContent = `done ${p.done} · left ${p.left}` + (p.flagged ? ` · flagged ${p.flagged}` : "");
  }

  function showFlag() {
    $("flag").setAttribute("aria-pressed", String(flagged));
    $("flag").classList.toggle("on", flagged);
    $("note-box").hidden = !flagged;
  }

  function showConflict(revision) {
    conflict = revision;
    $("conflict").hidden = revision === null;
    if (revision !== null) {
      $("conflict-text").textContent = `You saved this item in another tab or window (revision ${revision}) after ` +
        "this page loaded it, so what this page shows is not saved. Show the saved version, or overwrite it with " +
        "this page's.";
    }
  }

  // --- drafts: this tab's unsent state of an item survives a reload ------------------------------------------

  function readJson(storage, key) {
    try {
      return JSON.parse(storage.getItem(key) || "null");
    } catch {
      return null;
    }
  }

  function currentOrder() {
    return Array.from(list.children, (li) => Number(li.dataset.id));
  }

  function currentRatings() {
    const out = {};
    for (const li of list.children) {
      const input = li.querySelector("input[type=range]");
      if (input && li.dataset.rated === "1") out[li.dataset.id] = Number(input.value);
    }
    return out;
  }

  function saveDraft() {
    if (!item) return;
    const draft = mode === "rank" ? { order: currentOrder() } : { ratings: currentRatings() };
    sessionStorage.setItem(draftKey(item.item_id), JSON.stringify({ ...draft, revision: baseRevision }));
  }

  // A submission the server refused as stale: kept as this tab's draft of its item, against its old revision,
  // so the item shows it with the conflict notice (and "Overwrite" can still send it).
  function draftFrom(payload) {
    const draft = payload.action === "rank" ? { order: payload.order }
      : payload.action === "rate" ? { ratings: Object.fromEntries(payload.ratings.map((r) => [r.candidate_id, r.rating])) }
        : null;
    if (draft) sessionStorage.setItem(draftKey(payload.item_id), JSON.stringify({ ...draft, revision: payload.base_revision }));
  }

  // --- rendering -----------------------------------------------------------------------------------------

  function button(label, title, onClick) {
    const b = document.createElement("button");
    b.type = "button";
    b.textContent = label;
    b.title = title;
    b.setAttribute("aria-label", title);
    b.tabIndex = -1;
    b.addEventListener("click", onClick);
    return b;
  }

  function candidateRow(candidate, rating) {
    const li = document.createElement("li");
    li.className = "candidate";
    li.tabIndex = 0;
    li.dataset.id = String(candidate.id);
    const text = document.createElement("span");
    text.className = candidate.text === "" ? "text empty" : "text";
    text.textContent = candidate.text;
    if (mode === "rank") {
      const place = document.createElement("span"); // numbered by renumber(): the key that moves a candidate here
      place.className = "place";
      const handle = document.createElement("span");
      handle.className = "handle";
      handle.textContent = "⠿";
      handle.title = "drag to reorder";
      li.append(place, handle, text, button("▲", "move up", () => move(li, -1)),
        button("▼", "move down", () => move(li, 1)));
    } else {
      const input = document.createElement("input");
      input.type = "range";
      input.min = String(ratingMin);
      input.max = String(ratingMax);
      input.step = String(ratingStep);
      input.setAttribute("aria-label", "rating");
      const shown = document.createElement("output");
      li.dataset.rated = rating === undefined ? "0" : "1";
      input.value = String(rating === undefined ? (ratingMin + ratingMax) / 2 : rating);
      shown.textContent = rating === undefined ? "unrated" : input.value;
      input.addEventListener("input", () => {
        li.dataset.rated = "1";
        shown.textContent = input.value;
        saveDraft();
      });
      li.append(text, input, shown);
    }
    return li;
  }

  // Each candidate shows its place, 1 = best: the number key that moves the selected candidate there.
  function renumber() {
    if (mode !== "rank") return;
    Array.from(list.children).forEach((li, index) => {
      const place = li.querySelector(".place");
      place.textContent = String(index + 1);
      place.title = index < 9 ? `place ${index + 1} (key ${index + 1} moves the selected candidate here)` : "";
    });
  }

  function sameSet(ids, byId) {
    return ids.length === byId.size && ids.every((id) => byId.has(id));
  }

  function render(view) {
    item = view;
    $("task").hidden = false;
    $("finished").hidden = true;
    $("source").textContent = view.source;
    $("item-label").textContent = `item ${view.item_id}`;
    const mine = view.annotation;
    const saved = mine ? mine.revision : 0;
    flagged = Boolean(mine && mine.flagged);
    $("note").value = mine ? mine.note : "";
    showFlag();
    const byId = new Map(view.candidates.map((c) => [c.id, c]));
    const draft = readJson(sessionStorage, draftKey(view.item_id));
    baseRevision = draft && Number.isInteger(draft.revision) ? draft.revision : saved;
    let order = view.candidates.map((c) => c.id);
    if (draft && Array.isArray(draft.order) && sameSet(draft.order, byId)) order = draft.order;
    else if (mine && mine.order.length && sameSet(mine.order, byId)) order = mine.order;
    const ratings = new Map((mine ? mine.ratings : []).map((r) => [r.candidate_id, r.rating]));
    if (draft && draft.ratings) {
      for (const [id, value] of Object.entries(draft.ratings)) if (byId.has(Number(id))) ratings.set(Number(id), value);
    }
    list.replaceChildren(...order.map((id) => candidateRow(byId.get(id), ratings.get(id))));
    renumber();
    showConflict(saved > baseRevision ? saved : null); // this tab's draft was made before a save elsewhere
    setStatus(mine ? `You ${mine.status} this item before; submitting again replaces that.` : "");
    if (list.firstElementChild) list.firstElementChild.focus();
  }

  async function load() {
    const next = await api("GET", "/api/next");
    showProgress(next.progress);
    const view = fixedItem ? await api("GET", `/api/items/${encodeURIComponent(fixedItem)}`) : next.item;
    if (view) {
      render(view);
    } else {
      item = null;
      showConflict(null);
      $("task").hidden = true;
      $("finished").hidden = false;
    }
  }

  // --- ranking: keyboard and drag ------------------------------------------------------------------------

  function move(li, direction) {
    if (direction < 0 && li.previousElementSibling) list.insertBefore(li, li.previousElementSibling);
    else if (direction > 0 && li.nextElementSibling) list.insertBefore(li.nextElementSibling, li);
    renumber();
    li.focus();
    saveDraft();
  }

  function moveTo(li, index) {
    const others = Array.from(list.children).filter((x) => x !== li);
    list.insertBefore(li, others[index] || null);
    renumber();
    li.focus();
    saveDraft();
  }

  list.addEventListener("keydown", (event) => {
    const li = event.target.closest("li.candidate");
    if (!li || event.ctrlKey || event.metaKey) return;
    if (event.key === "ArrowUp" || event.key === "ArrowDown") {
      const direction = event.key === "ArrowUp" ? -1 : 1;
      if (mode === "rank" && (event.shiftKey || event.altKey)) move(li, direction);
      else (direction < 0 ? li.previousElementSibling : li.nextElementSibling)?.focus();
      event.preventDefault();
    } else if (mode === "rank" && /^[1-9]$/.test(event.key)) {
      moveTo(li, Number(event.key) - 1);
      event.preventDefault();
    } else if (mode === "rate" && event.target === li && (event.key === "ArrowLeft" || event.key === "ArrowRight")) {
      const input = li.querySelector("input[type=range]");
      if (event.key === "ArrowLeft") input.stepDown();
      else input.stepUp();
      input.dispatchEvent(new Event("input"));
      event.preventDefault();
    }
  });

  // Pointer events (mouse, pen, touch) rather than HTML5 drag-and-drop: one code path, and the item follows
  // the pointer over the list.
  list.addEventListener("pointerdown", (event) => {
    const handle = event.target.closest(".handle");
    if (!handle || mode !== "rank") return;
    dragging = handle.closest("li");
    dragging.setPointerCapture(event.pointerId);
    dragging.classList.add("dragging");
    event.preventDefault();
  });

  list.addEventListener("pointermove", (event) => {
    if (!dragging) return;
    let before = null;
    for (const other of list.children) {
      if (other === dragging) continue;
      const box = other.getBoundingClientRect();
      if (event.clientY < box.top + box.height / 2) {
        before = other;
        break;
      }
    }
    if (before !== dragging.nextElementSibling) {
      list.insertBefore(dragging, before);
      renumber();
    }
  });

  function endDrag() {
    if (!dragging) return;
    dragging.classList.remove("dragging");
    dragging.focus();
    dragging = null;
    saveDraft();
  }

  list.addEventListener("pointerup", endDrag);
  list.addEventListener("pointercancel", endDrag);

  // --- submitting ----------------------------------------------------------------------------------------

  // The server's answer, or null: then the status line says why.
  async function send(payload) {
    setStatus("saving…");
    try {
      const result = await api("POST", "/api/submissions", payload);
      localStorage.removeItem(pendingKey(payload.item_id));
      sessionStorage.removeItem(draftKey(payload.item_id));
      if (channel && result.annotation) channel.postMessage({ item_id: payload.item_id, revision: result.annotation.revision });
      showProgress(result.progress);
      setStatus(result.duplicate ? "Already saved." : "Saved.", "ok");
      return result;
    } catch (error) {
      if (error.status && error.status < 500 && error.status !== 401) {
        localStorage.removeItem(pendingKey(payload.item_id)); // refused for good: resending cannot help
        if (error.status === 409 && Number.isInteger(error.data?.revision)) {
          stale(payload, error.data.revision);
        } else {
          setStatus(`Not saved: ${error.message}`, "error");
        }
      } else {
        setStatus(`Not saved yet (${error.message}); it is kept and sent again on Enter or when the page reloads.`,
          "error");
      }
      return null;
    }
  }

  // A submission refused because the item was saved elsewhere since (now at `revision`). On the item shown, the
  // notice asks what to do, unless the screen already builds on that revision (an older try of another tab);
  // another item keeps it as this tab's draft, with the notice when it is shown.
  function stale(payload, revision) {
    setStatus(`Not saved: item ${payload.item_id} was saved in another tab or window since.`, "error");
    if (!item || item.item_id !== payload.item_id) draftFrom(payload);
    else if (revision > baseRevision) {
      showConflict(revision);
      saveDraft();
    }
  }

  // What a submission says, without its id: a pending one still matches the screen when these are equal.
  function content(p) {
    return JSON.stringify([p.item_id, p.action, p.order || [], p.ratings || [], Boolean(p.flagged), p.note || "",
      p.base_revision ?? null]);
  }

  function readPending(key) {
    const record = readJson(localStorage, key);
    return record && record.payload ? record : null;
  }

  // One at a time, and until the screen after it is shown: a second Enter pressed meanwhile would submit the
  // item just saved again, against the revision before that save.
  async function exclusively(task) {
    if (!item || busy) return;
    busy = true;
    $("task").setAttribute("aria-busy", "true");
    try {
      await task();
    } finally {
      busy = false;
      $("task").setAttribute("aria-busy", "false");
    }
  }

  function submit(action, overwrite = false) {
    return exclusively(() => submitNow(action, overwrite));
  }

  async function submitNow(action, overwrite) {
    if (conflict !== null && !overwrite) {
      setStatus("Not saved: this item was saved in another tab or window since. Show the saved version, or " +
        "overwrite it.", "error");
      return;
    }
    const payload = {
      submission_id: newSubmissionId(), item_id: item.item_id, action,
      flagged, note: flagged ? $("note").value : "", base_revision: overwrite ? conflict : baseRevision,
    };
    if (action === "rank") payload.order = currentOrder();
    if (action === "rate") {
      const ratings = currentRatings();
      if (Object.keys(ratings).length !== list.children.length) {
        setStatus("Rate every candidate first (or skip the item).", "error");
        return;
      }
      payload.ratings = Object.entries(ratings).map(([id, rating]) => ({ candidate_id: Number(id), rating }));
    }
    const key = pendingKey(item.item_id);
    const pending = readPending(key);
    if (pending) {
      if (content(pending.payload) === content(payload)) {
        // The last try of this item never got an answer and the screen still shows it: resend under its id.
        if (await send(pending.payload)) await afterSubmit();
        return;
      }
      // The screen changed since that try: settle it first under its own id (applied at most once, and a late
      // copy of it can no longer land after the new one), then send what the screen shows under a new id.
      const settled = await send(pending.payload);
      if (!settled && (readPending(key) || conflict !== null)) return; // still unsent, or stale: the notice asks
      // This page's own earlier try, applied now or before, moved the revision on by one, and the screen builds
      // on it. Another tab's did not: if it moved the revision, the new submission is told so.
      const own = pending.page === pageId && Number.isInteger(pending.payload.base_revision);
      if (settled && own && !overwrite) payload.base_revision = pending.payload.base_revision + 1;
    }
    localStorage.setItem(key, JSON.stringify({ page: pageId, payload }));
    if (await send(payload)) await afterSubmit();
  }

  async function afterSubmit() {
    const status = $("status").textContent;
    showConflict(null);
    if (fixedItem) render(await api("GET", `/api/items/${encodeURIComponent(fixedItem)}`));
    else await load();
    setStatus(status, "ok");
  }

  async function showSaved() {
    sessionStorage.removeItem(draftKey(item.item_id));
    render(await api("GET", `/api/items/${encodeURIComponent(item.item_id)}`));
    setStatus("This is the saved version.", "ok");
  }

  // The task's buttons never take the focus from the candidates: Enter must reach submit(), not re-press
  // the button last clicked (a focused Flag would be un-flagged by Enter).
  function focusCandidate() {
    const active = document.activeElement;
    if (active && active.closest && active.closest("#candidates li")) return;
    (lastCandidate && lastCandidate.isConnected ? lastCandidate : list.firstElementChild)?.focus();
  }

  list.addEventListener("focusin", (event) => {
    lastCandidate = event.target.closest("li.candidate") || lastCandidate;
  });

  for (const id of ["submit", "skip", "flag", "show-saved", "overwrite"]) {
    $(id).addEventListener("mousedown", (event) => event.preventDefault()); // a click leaves the focus alone
  }
  $("submit").addEventListener("click", () => submit(mode));
  $("skip").addEventListener("click", () => {
    submit("skip");
    focusCandidate();
  });
  $("flag").addEventListener("click", () => {
    flagged = !flagged;
    showFlag();
    focusCandidate();
  });
  $("show-saved").addEventListener("click", () => exclusively(showSaved).catch((error) => setStatus(error.message, "error")));
  $("overwrite").addEventListener("click", () => {
    submit(mode, true);
    focusCandidate();
  });

  if (channel) {
    channel.addEventListener("message", (event) => {
      const saved = event.data || {};
      if (item && saved.item_id === item.item_id && saved.revision > (conflict ?? baseRevision)) {
        showConflict(saved.revision);
        setStatus("");
      }
    });
  }

  document.addEventListener("keydown", (event) => {
    const target = event.target;
    if (event.ctrlKey || event.metaKey || event.altKey || !item) return;
    if (event.key === "Enter" && target.closest("#actions")) {
      // Enter submits even on the Flag or Skip button (reached with Tab); Space still presses them.
      submit(mode);
      event.preventDefault();
      return;
    }
    if (target.closest("textarea, input:not([type=range]), button, a, summary")) return;
    const key = event.key.toLowerCase();
    if (event.key === "Enter") submit(mode);
    else if (key === "s") submit("skip");
    else if (key === "f") $("flag").click();
    else return;
    event.preventDefault();
  });

  // Unanswered submissions of this annotator (from before a reload, a lost connection, or another tab): sent
  // again under their ids, so never applied twice; one the item moved past comes back as a draft (draftFrom).
  async function resendPending() {
    const legacy = readJson(localStorage, legacyPendingKey);
    if (legacy && legacy.item_id !== undefined) {
      localStorage.setItem(pendingKey(legacy.item_id), JSON.stringify({ page: null, payload: legacy }));
    }
    localStorage.removeItem(legacyPendingKey);
    const keys = [];
    for (let k = 0; k < localStorage.length; k++) {
      const key = localStorage.key(k);
      const match = key && key.startsWith(pendingPrefix) && /^(-?\d+)\.(.*)$/s.exec(key.slice(pendingPrefix.length));
      if (match && match[2] === annotator) keys.push(key);
    }
    let sent = false;
    for (const key of keys) {
      const pending = readPending(key);
      if (pending) {
        await send(pending.payload);
        sent = true;
      }
    }
    return sent;
  }

  async function start() {
    const resent = await resendPending();
    const [text, kind] = [$("status").textContent, $("status").className];
    await load();
    // render() clears the status for the item it shows: keep the resend's outcome in view instead.
    if (resent && (!$("status").textContent || $("status").textContent.startsWith("You "))) setStatus(text, kind);
  }

  start().catch((error) => setStatus(`Could not load: ${error.message}`, "error"));
})();
