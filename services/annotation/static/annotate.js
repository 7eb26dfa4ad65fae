// rlt2t annotation page: rank candidates (drag or keyboard) or rate them, skip, flag; no build step, no library.
// Texts only ever go into the page through textContent: a candidate holding markup shows as that markup.
// Every submission carries a client-generated id and stays in localStorage until the server acknowledged it,
// so a reload, a lost answer or a server restart neither loses nor duplicates it; an unsent ranking of the
// current item is kept as a draft, so a reload resumes where the annotator was.
"use strict";

(() => {
  const body = document.body;
  const csrf = document.querySelector('meta[name="csrf-token"]').content;
  const mode = body.dataset.mode;
  const fixedItem = body.dataset.itemId;
  const ratingMin = Number(body.dataset.ratingMin);
  const ratingMax = Number(body.dataset.ratingMax);
  const ratingStep = Number(body.dataset.ratingStep);
  const pendingKey = `rlt2t.pending.${body.dataset.annotator}`;
  const draftKey = (itemId) => `rlt2t.draft.${body.dataset.annotator}.${itemId}`;
  const $ = (id) => document.getElementById(id);
  const list = $("candidates");
  let item = null;
  let flagged = false;
  let busy = false;
  let dragging = null;

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
      throw Object.assign(new Error(describe(data.detail) || response.statusText), { status: response.status });
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

  // --- drafts: the unsent state of an item survives a reload ------------------------------------------------

  function readJson(key) {
    try {
      return JSON.parse(localStorage.getItem(key) || "null");
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
    localStorage.setItem(draftKey(item.item_id), JSON.stringify(draft));
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
      const handle = document.createElement("span");
      handle.className = "handle";
      handle.textContent = "⠿";
      handle.title = "drag to reorder";
      li.append(handle, text, button("▲", "move up", () => move(li, -1)), button("▼", "move down", () => move(li, 1)));
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
    flagged = Boolean(mine && mine.flagged);
    $("note").value = mine ? mine.note : "";
    showFlag();
    const byId = new Map(view.candidates.map((c) => [c.id, c]));
    const draft = readJson(draftKey(view.item_id));
    let order = view.candidates.map((c) => c.id);
    if (draft && Array.isArray(draft.order) && sameSet(draft.order, byId)) order = draft.order;
    else if (mine && mine.order.length && sameSet(mine.order, byId)) order = mine.order;
    const ratings = new Map((mine ? mine.ratings : []).map((r) => [r.candidate_id, r.rating]));
    if (draft && draft.ratings) {
      for (const [id, value] of Object.entries(draft.ratings)) if (byId.has(Number(id))) ratings.set(Number(id), value);
    }
    list.replaceChildren(...order.map((id) => candidateRow(byId.get(id), ratings.get(id))));
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
      $("task").hidden = true;
      $("finished").hidden = false;
    }
  }

  // --- ranking: keyboard and drag ------------------------------------------------------------------------

  function move(li, direction) {
    if (direction < 0 && li.previousElementSibling) list.insertBefore(li, li.previousElementSibling);
    else if (direction > 0 && li.nextElementSibling) list.insertBefore(li.nextElementSibling, li);
    li.focus();
    saveDraft();
  }

  function moveTo(li, index) {
    const others = Array.from(list.children).filter((x) => x !== li);
    list.insertBefore(li, others[index] || null);
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
    if (before !== dragging.nextElementSibling) list.insertBefore(dragging, before);
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

  async function send(payload) {
    busy = true;
    setStatus("saving…");
    try {
      const result = await api("POST", "/api/submissions", payload);
      localStorage.removeItem(pendingKey);
      localStorage.removeItem(draftKey(payload.item_id));
      showProgress(result.progress);
      setStatus(result.duplicate ? "Already saved." : "Saved.", "ok");
      return true;
    } catch (error) {
      if (error.status && error.status < 500 && error.status !== 401) {
        localStorage.removeItem(pendingKey); // refused for good (invalid, conflicting): resending cannot help
        setStatus(`Not saved: ${error.message}`, "error");
      } else {
        setStatus(`Not saved yet (${error.message}); it is kept and sent again on Enter or when the page reloads.`,
          "error");
      }
      return false;
    } finally {
      busy = false;
    }
  }

  // What a submission says, without its id: a pending one still matches the screen when these are equal.
  function content(p) {
    return JSON.stringify([p.item_id, p.action, p.order || [], p.ratings || [], Boolean(p.flagged), p.note || ""]);
  }

  async function submit(action) {
    if (!item || busy) return;
    const payload = {
      submission_id: newSubmissionId(), item_id: item.item_id, action,
      flagged, note: flagged ? $("note").value : "",
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
    const pending = readJson(pendingKey);
    if (pending && pending.item_id === item.item_id) {
      if (content(pending) === content(payload)) {
        // The last try of this item never got an answer and the screen still shows it: resend under its id.
        if (await send(pending)) await afterSubmit();
        return;
      }
      // The screen changed since that try: settle it first under its own id (applied at most once, and a late
      // copy of it can no longer land after the new one), then send what the screen shows under a new id.
      if (!(await send(pending)) && readJson(pendingKey)) return; // still unsent: keep it, try again later
    }
    localStorage.setItem(pendingKey, JSON.stringify(payload));
    if (await send(payload)) await afterSubmit();
  }

  async function afterSubmit() {
    if (fixedItem) {
      const view = await api("GET", `/api/items/${encodeURIComponent(fixedItem)}`);
      const status = $("status").textContent;
      render(view);
      setStatus(status, "ok");
    } else {
      const status = $("status").textContent;
      await load();
      setStatus(status, "ok");
    }
  }

  $("submit").addEventListener("click", () => submit(mode));
  $("skip").addEventListener("click", () => submit("skip"));
  $("flag").addEventListener("click", () => {
    flagged = !flagged;
    showFlag();
  });

  document.addEventListener("keydown", (event) => {
    const target = event.target;
    if (event.ctrlKey || event.metaKey || event.altKey || !item) return;
    if (target.closest("textarea, input:not([type=range]), button, a, summary")) return;
    const key = event.key.toLowerCase();
    if (event.key === "Enter") submit(mode);
    else if (key === "s") submit("skip");
    else if (key === "f") $("flag").click();
    else return;
    event.preventDefault();
  });

  async function start() {
    const pending = readJson(pendingKey);
    if (pending) await send(pending); // from before a reload or a lost connection; same id, so never twice
    const [text, kind] = [$("status").textContent, $("status").className];
    await load();
    // render() clears the status for the item it shows: keep the resend's outcome in view instead.
    if (pending && !$("status").textContent) setStatus(text, kind);
  }

  start().catch((error) => setStatus(`Could not load: ${error.message}`, "error"));
})();
