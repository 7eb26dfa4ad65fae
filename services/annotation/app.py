"""The annotation web app: annotators rank (or rate) a policy's candidates in the browser.

    app = create_app(cfg)                               # opens annotate.database_url, migrating it
    uvicorn.run(app, host="127.0.0.1", port=8002)       # or: rlt2t annotate serve

Pages (server-rendered HTML, escaped by Jinja2's autoescape; the page script fills in texts with
``textContent`` only, and the Content-Security-Policy allows no inline script at all):
``/login``, ``/`` (the next item of the queue), ``/items/{id}`` (one item, to revisit or edit), ``/history``
(one's own annotations; an admin may pick anyone's), ``/admin`` (counts, agreement, flags, exports).

JSON API (``schemas``): ``GET /api/me``, ``/api/next``, ``/api/items/{id}``, ``POST /api/submissions``,
``GET /api/annotations[/{id}]``, admin: ``/api/admin/summary``, ``/api/admin/export/{ranks.tsv,pairs.jsonl,
ratings.jsonl}``; ops: ``/healthz``, ``/readyz`` and ``/metrics`` (admin); the OpenAPI document
``/openapi.json`` (logged in).

Bodies go through the services' request gate (``rlt2t.services.http.RequestGate``): JSON in UTF-8 (the login
and logout forms: urlencoded, UTF-8), else a 415 as from the policy and reward servers; at most
``annotate.max_body_bytes`` (413).

Authentication: each annotator has a bearer token (``rlt2t annotate add-user``). Scripts send
``Authorization: Bearer <token>``; a browser logs in once with name and token and gets a session cookie
(HttpOnly, SameSite=Lax). Requests that change anything under a cookie must carry the session's CSRF token
(``X-CSRF-Token`` header from the page's ``<meta name="csrf-token">``, or a ``csrf`` form field); the login
form itself is protected by a double-submit cookie. An annotator reads and edits only their own annotations
(another's answer 404, as if absent); admins read everything. Every route but ``/healthz``, ``/login`` and the
static files needs a login, the OpenAPI document included.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import parse_qs, quote

import jinja2
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool

from rlt2t.common.config import Config
from rlt2t.services.annotation import export
from rlt2t.services.annotation.agreement import agreement
from rlt2t.services.annotation.schemas import (
    MAX_ID,
    MAX_OFFSET,
    PAGE_SIZE,
    AdminSummary,
    AnnotationList,
    AnnotationView,
    AnnotatorStatsView,
    CandidateRating,
    CandidateView,
    FlaggedView,
    ItemView,
    Me,
    NextResponse,
    PairAgreementView,
    Progress,
    StaleRevisionResponse,
    StoredText,
    SubmissionRequest,
    SubmissionResponse,
)
from rlt2t.services.annotation.store import (
    AnnotationRecord,
    Annotator,
    InvalidSubmission,
    Item,
    NotFound,
    StaleRevision,
    Store,
    Submission,
    SubmissionConflict,
    display_order,
    open_store,
)
from rlt2t.services.http import (
    BODY_REFUSED,
    OpenApiResponses,
    RequestGate,
    ServiceMetrics,
    add_common_routes,
    field_error,
    install_error_handlers,
)
from rlt2t.services.schemas import ErrorResponse

log = logging.getLogger("rlt2t.services.annotation")

HERE = Path(__file__).resolve().parent
SESSION_COOKIE = "rlt2t_session"
LOGIN_CSRF_COOKIE = "rlt2t_login_csrf"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
SECURITY_HEADERS = [
    # No inline script or style anywhere: an injected <script> could not run even if escaping failed.
    (b"content-security-policy", b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                                 b"connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"same-origin"),
]
ERRORS: OpenApiResponses = {401: {"model": ErrorResponse, "description": "Not logged in, or a wrong bearer token"},
          403: {"model": ErrorResponse, "description": "Missing CSRF token, or an admin route"}}
FORM_PATHS = ("/login", "/logout")
"""The routes that take a urlencoded form; every other body is JSON."""


class SecurityHeaders:
    """Pure ASGI middleware adding SECURITY_HEADERS (and no-store on everything but static files)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        static = scope["path"].startswith("/static/")

        async def send_with_headers(message) -> None:
            if message["type"] == "http.response.start":
                extra = SECURITY_HEADERS if static else [*SECURITY_HEADERS, (b"cache-control", b"no-store")]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


@dataclass(frozen=True, slots=True)
class Principal:
    annotator: Annotator
    csrf: str | None
    """The session's CSRF token; None for bearer-token requests (a browser never sends those by itself)."""


def _annotation_view(a: AnnotationRecord) -> AnnotationView:
    return AnnotationView(annotation_id=a.id, item_id=a.item_id, annotator=a.annotator, status=a.status,
                          order=list(a.order), flagged=a.flagged, note=a.note, updated_at=a.updated_at,
                          revision=a.revision,
                          ratings=[CandidateRating(candidate_id=c, rating=v) for c, v in sorted(a.ratings.items())])


def _safe_next(target: str | None) -> str:
    """Where to go after logging in: a local path only (never `//host` or a URL: no open redirect)."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target


async def _form(request: Request) -> dict[str, str]:
    """The fields of a small urlencoded form post (first value of each); a malformed one is a 422."""
    try:
        fields = parse_qs((await request.body()).decode("utf-8"), keep_blank_values=True, max_num_fields=8)
    except (UnicodeDecodeError, ValueError) as e:
        raise field_error(("body",), f"not a valid login/logout form: {e}") from None
    return {k: v[0] for k, v in fields.items()}


def create_app(cfg: Config, store: Store | None = None) -> FastAPI:
    """The annotation app over ``store`` (default: open ``annotate.database_url``, closed at shutdown)."""
    a = cfg.annotate
    owned = store is None
    store = open_store(cfg) if store is None else store
    templates = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True,
                                   undefined=jinja2.StrictUndefined)
    metrics = ServiceMetrics("rlt2t_annotate")

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        log.info("annotation database: %s (%d items)", store.url, store.count_items())
        yield
        if owned:
            store.close()

    # The OpenAPI document is served below, behind the login (FastAPI's own route would answer anyone).
    app = FastAPI(title="rlt2t annotation", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.store = store
    install_error_handlers(app)
    app.add_middleware(RequestGate, token=None, max_bytes=a.max_body_bytes, body_timeout_s=30.0,
                       form_paths=FORM_PATHS, setting="annotate.max_body_bytes")
    app.add_middleware(SecurityHeaders)
    metrics.install(app)
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")

    @app.exception_handler(NotFound)
    async def not_found(request: Request, exc: NotFound) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(SubmissionConflict)
    async def conflict(request: Request, exc: SubmissionConflict) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.exception_handler(StaleRevision)
    async def stale(request: Request, exc: StaleRevision) -> JSONResponse:
        body = StaleRevisionResponse(detail=str(exc), revision=exc.revision,
                                     annotation=_annotation_view(exc.current) if exc.current else None)
        return JSONResponse(body.model_dump(mode="json"), status_code=409)

    # --- who is asking -------------------------------------------------------------------------------------

    def principal(request: Request) -> Principal | None:
        header = request.headers.get("authorization")
        if header is not None:
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                return None
            annotator = store.annotator_by_token(token.strip())
            return Principal(annotator, None) if annotator else None
        cookie = request.cookies.get(SESSION_COOKIE)
        if cookie:
            found = store.session(cookie)
            if found is not None:
                return Principal(*found)
        return None

    def api_user(request: Request) -> Principal:
        """Dependency: the caller, with the CSRF check for cookie-authenticated writes."""
        who = principal(request)
        if who is None:
            raise HTTPException(401, "log in at /login or send Authorization: Bearer <your annotator token>",
                                headers={"WWW-Authenticate": "Bearer"})
        if request.method not in SAFE_METHODS and who.csrf is not None:
            sent = request.headers.get("x-csrf-token", "")
            if not secrets.compare_digest(sent.encode(), who.csrf.encode()):
                raise HTTPException(403, "missing or wrong X-CSRF-Token header (the page's csrf-token)")
        return who

    def admin_user(who: Principal = Depends(api_user)) -> Principal:  # noqa: B008
        if not who.annotator.is_admin:
            raise HTTPException(403, "admins only")
        return who

    def progress_of(annotator: Annotator) -> Progress:
        p = store.progress(annotator, a.max_annotators_per_item)
        return Progress(done=p.done, left=p.left, skipped=p.skipped, flagged=p.flagged)

    def item_view(item: Item, annotator: Annotator) -> ItemView:
        mine = store.annotation_of(annotator, item.id)
        return ItemView(item_id=item.id, source=item.source,
                        candidates=[CandidateView(id=c.id, text=c.text)
                                    for c in display_order(item, annotator.id, a.shuffle_candidates)],
                        annotation=_annotation_view(mine) if mine else None)

    # --- pages ---------------------------------------------------------------------------------------------

    def render(name: str, status: int = 200, **context) -> HTMLResponse:
        return HTMLResponse(templates.get_template(name).render(**context), status_code=status)

    def login_page(next_path: str, error: str = "", status: int = 200) -> HTMLResponse:
        token = secrets.token_urlsafe(32)
        page = render("login.html", status, csrf=token, next=next_path, error=error)
        page.set_cookie(LOGIN_CSRF_COOKIE, token, max_age=3600, httponly=True, samesite="strict",
                        secure=a.secure_cookies, path="/login")
        return page

    def page_user(request: Request) -> Principal | None:
        cookie = request.cookies.get(SESSION_COOKIE)
        found = store.session(cookie) if cookie else None
        return Principal(*found) if found else None

    def to_login(request: Request) -> RedirectResponse:
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return RedirectResponse(f"/login?next={quote(target, safe='')}", status_code=303)

    def annotate_page(request: Request, item_id: int | None) -> Response:
        who = page_user(request)
        if who is None:
            return to_login(request)
        return render("annotate.html", me=who.annotator, csrf=who.csrf, cfg=a,
                      item_id="" if item_id is None else str(item_id))

    @app.get("/login", response_class=HTMLResponse, include_in_schema=False)
    def login_form(request: Request, next: str = "/") -> Response:  # noqa: A002 - the query parameter's name
        if page_user(request) is not None:
            return RedirectResponse(_safe_next(next), status_code=303)
        return login_page(_safe_next(next))

    @app.post("/login", include_in_schema=False)
    async def login(request: Request) -> Response:
        form = await _form(request)  # the gate has checked its content type (FORM_PATHS)
        next_path = _safe_next(form.get("next"))
        expected = request.cookies.get(LOGIN_CSRF_COOKIE, "")
        if not expected or not secrets.compare_digest(form.get("csrf", "").encode(), expected.encode()):
            return login_page(next_path, "The form expired; please log in again.", 403)
        annotator = await run_in_threadpool(store.annotator_by_token, form.get("token", "").strip())
        if annotator is None or annotator.name != form.get("name", "").strip():
            return login_page(next_path, "Unknown name or token.", 401)
        session, _csrf = await run_in_threadpool(store.create_session, annotator, a.session_hours * 3600)
        response = RedirectResponse(next_path, status_code=303)
        response.set_cookie(SESSION_COOKIE, session, max_age=int(a.session_hours * 3600), httponly=True,
                            samesite="lax", secure=a.secure_cookies, path="/")
        response.delete_cookie(LOGIN_CSRF_COOKIE, path="/login")
        return response

    @app.post("/logout", include_in_schema=False)
    async def logout(request: Request) -> Response:
        cookie = request.cookies.get(SESSION_COOKIE)
        found = await run_in_threadpool(store.session, cookie) if cookie else None
        if cookie and found is not None:
            form = await _form(request)
            if not secrets.compare_digest(form.get("csrf", "").encode(), found[1].encode()):
                return JSONResponse({"detail": "missing or wrong csrf form field"}, 403)
            await run_in_threadpool(store.delete_session, cookie)
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(SESSION_COOKIE, path="/")
        return response

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def index(request: Request) -> Response:
        return annotate_page(request, None)

    @app.get("/items/{item_id}", response_class=HTMLResponse, include_in_schema=False)
    def item_page(request: Request, item_id: int = PathParam(ge=-MAX_ID, le=MAX_ID)) -> Response:
        return annotate_page(request, item_id)

    @app.get("/history", response_class=HTMLResponse, include_in_schema=False)
    def history(request: Request, annotator: StoredText | None = None,
                page: int = Query(0, ge=0, le=MAX_OFFSET // PAGE_SIZE)) -> Response:
        who = page_user(request)
        if who is None:
            return to_login(request)
        rows, total = store.annotations(who.annotator, annotator=annotator, offset=page * PAGE_SIZE,
                                        limit=PAGE_SIZE)
        sources = {r.item_id: store.item(r.item_id).source for r in rows}
        return render("history.html", me=who.annotator, csrf=who.csrf, rows=rows, total=total, page=page,
                      sources=sources, annotator=annotator if who.annotator.is_admin else None,
                      more=(page + 1) * PAGE_SIZE < total)

    @app.get("/admin", response_class=HTMLResponse, include_in_schema=False)
    def admin_page(request: Request) -> Response:
        who = page_user(request)
        if who is None:
            return to_login(request)
        if not who.annotator.is_admin:
            return render("error.html", 403, me=who.annotator, csrf=who.csrf, message="This page is for admins.")
        return render("admin.html", me=who.annotator, csrf=who.csrf, summary=summary_of())

    # --- JSON API ------------------------------------------------------------------------------------------

    @app.get("/api/me", response_model=Me, tags=["annotation"], responses=ERRORS)
    def me(who: Principal = Depends(api_user)) -> Me:  # noqa: B008
        """The caller and how the app asks them to judge."""
        return Me(name=who.annotator.name, role=who.annotator.role, mode=a.mode, rating_min=a.rating_min,
                  rating_max=a.rating_max, rating_step=a.rating_step)

    @app.get("/api/next", response_model=NextResponse, tags=["annotation"], responses=ERRORS)
    def next_item(who: Principal = Depends(api_user)) -> NextResponse:  # noqa: B008
        """The first item of the caller's queue (partly rated items first come back here too)."""
        item = store.next_item(who.annotator, a.max_annotators_per_item)
        return NextResponse(item=item_view(item, who.annotator) if item else None,
                            progress=progress_of(who.annotator))

    @app.get("/api/items/{item_id}", response_model=ItemView, tags=["annotation"],
             responses={**ERRORS, 404: {"model": ErrorResponse, "description": "No such item"}})
    def get_item(item_id: int = PathParam(ge=-MAX_ID, le=MAX_ID),
                 who: Principal = Depends(api_user)) -> ItemView:  # noqa: B008
        """One item with the caller's own annotation of it."""
        return item_view(store.item(item_id), who.annotator)

    @app.post("/api/submissions", response_model=SubmissionResponse, tags=["annotation"],
              responses={**ERRORS, 404: {"model": ErrorResponse, "description": "No such item"},
                         409: {"model": StaleRevisionResponse | ErrorResponse,
                               "description": "The annotation moved on past `base_revision` (the answer names the "
                                              "current revision), or a submission id reused for other content"},
                         413: {"model": ErrorResponse, "description": "Body larger than annotate.max_body_bytes"},
                         415: BODY_REFUSED[415]})
    def submit(req: SubmissionRequest, who: Principal = Depends(api_user)) -> SubmissionResponse:  # noqa: B008
        """Rank, rate or skip an item, in one transaction; a repeated submission_id changes nothing. With
        `base_revision`, a 409 instead when the annotation was saved elsewhere since."""
        ratings: dict[int, float] = {}
        for k, r in enumerate(req.ratings):
            if r.candidate_id in ratings:
                raise field_error(("body", "ratings", k, "candidate_id"), f"candidate {r.candidate_id} rated twice")
            ratings[r.candidate_id] = r.rating
        if len(set(req.order)) != len(req.order):
            raise field_error(("body", "order"), "a candidate id appears twice")
        sub = Submission(submission_id=req.submission_id, item_id=req.item_id, action=req.action,
                         order=tuple(req.order), ratings=ratings, flagged=req.flagged, note=req.note,
                         base_revision=req.base_revision)
        try:
            outcome = store.submit(who.annotator, sub)
        except InvalidSubmission as e:
            raise field_error(("body", e.field), e.message) from None
        return SubmissionResponse(annotation=_annotation_view(outcome.annotation), duplicate=outcome.duplicate,
                                  progress=progress_of(who.annotator))

    @app.get("/api/annotations", response_model=AnnotationList, tags=["annotation"], responses=ERRORS)
    def list_annotations(annotator: StoredText | None = None, offset: int = Query(0, ge=0, le=MAX_OFFSET),
                         limit: int = Query(50, ge=1, le=500),
                         who: Principal = Depends(api_user)) -> AnnotationList:  # noqa: B008
        """The caller's annotations, newest first (an admin: everyone's, or `annotator`'s)."""
        rows, total = store.annotations(who.annotator, annotator=annotator, offset=offset, limit=limit)
        return AnnotationList(annotations=[_annotation_view(r) for r in rows], total=total)

    @app.get("/api/annotations/{annotation_id}", response_model=AnnotationView, tags=["annotation"],
             responses={**ERRORS, 404: {"model": ErrorResponse, "description": "No such annotation of yours"}})
    def get_annotation(annotation_id: int = PathParam(ge=-MAX_ID, le=MAX_ID),
                       who: Principal = Depends(api_user)) -> AnnotationView:  # noqa: B008
        """One annotation: the caller's own (an admin: anyone's); any other answers 404."""
        return _annotation_view(store.annotation(annotation_id, who.annotator))

    def summary_of() -> AdminSummary:
        report = agreement(store.judgements())
        return AdminSummary(
            items=store.count_items(),
            annotators=[AnnotatorStatsView(**asdict(s)) for s in store.annotator_stats()],
            agreement=[PairAgreementView(**asdict(p)) for p in report.pairs],
            mean_tau=report.mean_tau, comparisons=report.comparisons,
            flagged=[FlaggedView(**asdict(f)) for f in store.flagged()])

    @app.get("/api/admin/summary", response_model=AdminSummary, tags=["admin"], responses=ERRORS)
    def admin_summary(who: Principal = Depends(admin_user)) -> AdminSummary:  # noqa: B008
        """Per-annotator counts, pairwise Kendall τ-b on shared items, flagged items."""
        return summary_of()

    exports: dict[str, tuple[str, Callable]] = {
        export.FILES["ranks"]: ("text/tab-separated-values; charset=utf-8",
                                lambda inc: export.rank_tsv_lines(export.rank_lists(store, include_flagged=inc))),
        export.FILES["pairs"]: ("application/jsonl; charset=utf-8",
                                lambda inc: export.jsonl_lines(
                                    export.pair_rows(export.rank_lists(store, include_flagged=inc)))),
        export.FILES["ratings"]: ("application/jsonl; charset=utf-8",
                                  lambda inc: export.jsonl_lines(export.rating_rows(store, include_flagged=inc))),
    }

    @app.get("/api/admin/export/{name}", tags=["admin"], response_class=StreamingResponse,
             responses={**ERRORS, 404: {"model": ErrorResponse, "description": "Unknown export"}})
    def download(name: str, include_flagged: bool | None = None,
                 who: Principal = Depends(admin_user)) -> StreamingResponse:  # noqa: B008
        """ranks.tsv, pairs.jsonl or ratings.jsonl (see `rlt2t annotate export`)."""
        if name not in exports:
            raise NotFound(f"no export {name!r}; one of {sorted(exports)}")
        media, lines = exports[name]
        inc = a.include_flagged if include_flagged is None else include_flagged
        return StreamingResponse(lines(inc), media_type=media,
                                 headers={"Content-Disposition": f'attachment; filename="{name}"'})

    @app.get("/openapi.json", include_in_schema=False)
    def openapi_document(who: Principal = Depends(api_user)) -> JSONResponse:  # noqa: B008
        """This app's OpenAPI document, for any logged-in annotator (a cookie or a bearer token)."""
        return JSONResponse(app.openapi())

    add_common_routes(app, metrics, lambda: True, [Depends(admin_user)], ready_means="requests are accepted",
                      auth_errors={401: ERRORS[401], 403: {"model": ErrorResponse, "description": "Not an admin"}})
    return app
