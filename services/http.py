"""What the policy and reward apps share: the request gate, bearer-token auth, error answers, Prometheus
metrics, uvicorn's settings.

The gate (:class:`RequestGate`, pure ASGI, in front of everything but the metrics) decides from the
request head alone, before a byte of the body is read: the bearer token (401), the content type of a
body (415 unless ``application/json``, or a form on the paths an app names), the declared size (413). It
then reads the body within ``serve.max_body_bytes`` (413) and ``serve.body_timeout_s`` (408, connection
closed), refuses one that is not UTF-8 (415: JSON parsers would otherwise guess UTF-16 or UTF-32 from the
bytes and accept it) and replays it.

Auth: a token from ``serve.token_file`` (preferred) or the environment variable ``serve.token_env``;
when one is set every route but ``GET``/``HEAD /healthz`` needs ``Authorization: Bearer <token>``
(compared in constant time) and answers 401 otherwise: the OpenAPI document and the docs pages too.
No token configured: no auth (the servers bind 127.0.0.1 by default; bind elsewhere only with a token).

Errors: every error body is JSON that can be encoded whatever the input was (a lone surrogate in a
rejected string is echoed as ``\\udXXX`` text); an unexpected exception is a logged 500 and a bug.

Connections (:func:`uvicorn_config`): a request head must arrive within ``serve.header_timeout_s`` of
the connection (or of its previous response), else the connection is closed (uvicorn itself has no
such timeout); idle keep-alive connections close after ``serve.keepalive_timeout_s``.

Metrics: each app owns a ``CollectorRegistry`` (tests create many apps in one process; the global
registry would refuse the second one's metric names).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from pathlib import Path
from typing import Any, TypeAlias, TypeVar

import anyio
import anyio.to_thread
import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from rlt2t.common.config import ServeConfig
from rlt2t.common.tokenization import LONE_SURROGATE
from rlt2t.services.admission import ServiceTime
from rlt2t.services.batching import ClientGone, Overloaded, TooSlow
from rlt2t.services.schemas import ErrorResponse, Health, TooSlowResponse

log = logging.getLogger("rlt2t.services.http")
T = TypeVar("T")

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
OPEN_PATHS = ("/healthz",)
"""Paths answered without a token (GET and HEAD only)."""
CLIENT_CLOSED = 499
"""Status recorded (in metrics) for a request whose client disconnected before its answer."""

OpenApiResponses: TypeAlias = dict[int | str, dict[str, Any]]
"""A route's documented error answers (FastAPI's ``responses=``): status -> model and description."""

UNAUTHORIZED: OpenApiResponses = {401: {"model": ErrorResponse, "description": "Missing or wrong bearer token"}}
_RETRY_AFTER = {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}}
OVERLOADED: OpenApiResponses = {
    429: {"model": TooSlowResponse, "description": "Predicted to take longer than serve.request_timeout_s at this "
          "server's measured speed, even alone: refused before any work (ask for less work)"},
    503: {"model": ErrorResponse, "description": "Queue full, not answerable in serve.request_timeout_s behind the "
          "queued work, deadline passed or shutting down; retry after the Retry-After header's seconds",
          "headers": _RETRY_AFTER}}
NOT_READY: OpenApiResponses = {
    503: {"model": ErrorResponse, "description": "Not ready; retry after the Retry-After header's seconds",
          "headers": _RETRY_AFTER}}
BODY_REFUSED: OpenApiResponses = {
    408: {"model": ErrorResponse, "description": "Body not received within serve.body_timeout_s"},
    413: {"model": ErrorResponse, "description": "Body larger than serve.max_body_bytes"},
    415: {"model": ErrorResponse, "description": "Body not sent as application/json, or not UTF-8"},
}
"""What the gate may answer to any request with a body, before the route sees it."""


def load_token(serve: ServeConfig, base_dir: str | Path | None = None) -> str | None:
    """The bearer token: ``serve.token_file`` (relative to ``base_dir``), else ``$serve.token_env``."""
    if serve.token_file:
        path = Path(serve.token_file)
        if base_dir is not None and not path.is_absolute():
            path = Path(base_dir) / path
        if not path.is_file():
            raise FileNotFoundError(f"serve.token_file: {path} does not exist")
        token = path.read_text(encoding="utf-8").strip()
        if not token:
            raise ValueError(f"serve.token_file: {path} is empty")
        return _header_safe(token, f"serve.token_file ({path})")
    token = os.environ.get(serve.token_env, "").strip()
    return _header_safe(token, f"${serve.token_env}") if token else None


def _header_safe(token: str, where: str) -> str:
    """A token a client can send: HTTP header values are ASCII, so any other character would make every
    request fail with 401 (and most clients refuse to send it)."""
    if bad := [c for c in token if not "!" <= c <= "~"]:
        raise ValueError(f"{where}: the bearer token holds {bad[0]!r}; use printable ASCII without spaces "
                         "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
    return token


def check_exposure(serve: ServeConfig, host: str, token: str | None) -> None:
    """Refuse to listen beyond loopback without a bearer token (unless serve.allow_unauthenticated)."""
    import ipaddress

    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        loopback = False
    if not loopback and token is None and not serve.allow_unauthenticated:
        raise ValueError(f"serve.host={host} would expose the server beyond this machine without a bearer token: "
                         f"set serve.token_file or ${serve.token_env} (or serve.allow_unauthenticated=true)")


class CheckThread:
    """Runs a request's text checks, which tokenize every text, on one worker thread: off the event loop, so
    a large request never stalls the others or ``/healthz``, and one request at a time, as the tokenizer
    they use must not be borrowed by two threads at once."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._limiter: anyio.CapacityLimiter | None = None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # made on the loop that uses it (tests run one app on several loops)
            self._loop, self._limiter = loop, anyio.CapacityLimiter(1)
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)


def bearer_ok(authorization: str | None, expected: bytes) -> bool:
    """Whether an ``Authorization`` header value carries the bearer token (constant-time compare)."""
    scheme, _, given = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(given.strip().encode("utf-8", "replace"), expected)


def auth_dependencies(token: str | None) -> list[Any]:
    """FastAPI dependencies of protected routes (none when no token is configured): they put the bearer
    scheme into the OpenAPI document and check it again (the gate has checked it before the body)."""
    if token is None:
        return []
    expected = token.encode("utf-8")
    scheme = HTTPBearer(auto_error=False, description="the server's bearer token")

    # A default, not Annotated[...]: with postponed annotations FastAPI could not see the local `scheme`.
    async def require_token(request: Request,
                            credentials: HTTPAuthorizationCredentials | None = Depends(scheme)) -> None:  # noqa: B008
        if not bearer_ok(request.headers.get("authorization"), expected):
            raise HTTPException(401, "missing or invalid bearer token", headers={"WWW-Authenticate": "Bearer"})

    return [Depends(require_token)]


def field_error(loc: Sequence[str | int], msg: str, input_value: Any = None) -> RequestValidationError:
    """A 422 naming ``loc`` (e.g. ``("body", "sources", 3)``), in FastAPI's own validation-error shape."""
    return RequestValidationError([{"type": "value_error", "loc": tuple(loc), "msg": msg, "input": input_value}])


def disconnected(request: Request) -> Callable[[], Awaitable[None]]:
    """An awaitable factory completing when the client of ``request`` disconnects (after the body has been
    read, the server's next ``receive()`` message is the disconnect)."""

    async def wait() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return wait


class ServiceMetrics:
    """Prometheus metrics of one app: requests by route and status, latency by route."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.registry = CollectorRegistry()
        self.requests = Counter(f"{prefix}_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=self.registry)
        self.latency = Histogram(f"{prefix}_request_seconds", "Request latency by route", ["route"],
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.rejected = Counter(f"{prefix}_rejected", "Requests refused with 503 or 429 (queue full, predicted too "
                                "slow, deadline, stopping)", registry=self.registry)

    def track_service_time(self, timing: Callable[[], ServiceTime]) -> None:
        """Gauges of the service-time model the app predicts with (``timing()``: the current one): its scale and
        its calibrated seconds per feature, what a refusal's prediction was made of."""
        scale = Gauge(f"{self.prefix}_service_time_scale", "Measured over modelled seconds of the recent calls",
                      registry=self.registry)
        scale.set_function(lambda: timing().scale)
        per = Gauge(f"{self.prefix}_service_time_seconds_per", "Calibrated seconds per unit of each work feature",
                    ["feature"], registry=self.registry)

        def coefficient(i: int) -> Callable[[], float]:
            return lambda: timing().coefficients[i]

        for i, feature in enumerate(("step", "row_step", "context_position", "source_position")):
            per.labels(feature).set_function(coefficient(i))

    def install(self, app: FastAPI) -> None:
        """Count and time every request, labelled by its route template (never the raw path)."""
        app.add_middleware(_ObserveRequests, metrics=self)

    def observe(self, scope: dict, status: int, seconds: float) -> None:
        route = scope.get("route")
        label = getattr(route, "path", None)
        if label is None:  # refused by the gate before routing: find the route it was meant for
            app = scope.get("app")
            for candidate in getattr(getattr(app, "router", None), "routes", ()):
                if candidate.matches(scope)[0] != Match.NONE:
                    label = candidate.path
                    break
        # Unknown paths share one label: a scanner must not create one series per path it tries.
        self.requests.labels(label or "unmatched", str(status)).inc()
        self.latency.labels(label or "unmatched").observe(seconds)

    def render(self) -> Response:
        return PlainTextResponse(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


def install_middleware(app: FastAPI, metrics: ServiceMetrics, serve: ServeConfig, token: str | None) -> None:
    """The gate, then (outermost) the request metrics, so refusals are counted too."""
    app.add_middleware(RequestGate, token=token, max_bytes=serve.max_body_bytes, body_timeout_s=serve.body_timeout_s)
    metrics.install(app)


async def _answer(send, status: int, detail: str, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps({"detail": detail}).encode()  # ASCII: whatever the detail holds, it encodes
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


JSON = "application/json"
FORM = "application/x-www-form-urlencoded"
BODY_METHODS = ("POST", "PUT", "PATCH")


class RequestGate:
    """Pure ASGI middleware: everything decided from the request head before the body is read (auth 401,
    content type 415, declared size 413), then the body read within ``max_bytes`` (413) and
    ``body_timeout_s`` (408 + close), checked to be UTF-8 (415) and replayed to the app. See the module
    docstring.

    ``json_only``: a body must be ``application/json`` in UTF-8, except on ``form_paths``, where it must be an
    ``application/x-www-form-urlencoded`` form (UTF-8 too); False: any body goes through unchecked."""

    def __init__(self, app, *, token: str | None, max_bytes: int, body_timeout_s: float, json_only: bool = True,
                 form_paths: Collection[str] = (), setting: str = "serve.max_body_bytes") -> None:
        self.app, self.max_bytes, self.body_timeout_s, self.json_only = app, max_bytes, body_timeout_s, json_only
        self.form_paths = frozenset(form_paths)
        self.expected = token.encode("utf-8") if token is not None else None
        self.setting = setting  # named in the 413

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        scope.setdefault("state", {})["arrived"] = started  # request.state.arrived: deadlines count from here
        headers = dict(scope.get("headers") or [])
        method = scope["method"]
        open_route = scope["path"] in OPEN_PATHS and method in ("GET", "HEAD")
        if self.expected is not None and not open_route:
            authorization = headers.get(b"authorization", b"").decode("latin-1")
            if not bearer_ok(authorization, self.expected):
                await _answer(send, 401, "missing or invalid bearer token", [(b"www-authenticate", b"Bearer")])
                return
        media = (FORM if scope["path"] in self.form_paths else JSON) if self.json_only else None
        if media is not None and method in BODY_METHODS and (problem := _content_type_problem(headers, media)):
            await _answer(send, 415, problem)
            return
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(send)
            return
        chunks: list[bytes] = []
        try:
            async with asyncio.timeout_at(asyncio.get_running_loop().time() + self.body_timeout_s):
                size = 0
                while True:
                    message = await receive()
                    if message["type"] != "http.request":  # the client went away mid-body: nobody to answer
                        return
                    size += len(message.get("body", b""))
                    if size > self.max_bytes:
                        await self._too_large(send)
                        return
                    chunks.append(message.get("body", b""))
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            await _answer(send, 408, f"request body not received within {self.body_timeout_s:g}s "
                          "(serve.body_timeout_s)", [(b"connection", b"close")])
            return
        body, replayed = b"".join(chunks), False
        if media is not None and method in BODY_METHODS and (problem := _utf8_problem(body, media)):
            await _answer(send, 415, problem)
            return

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect notification

        await self.app(scope, replay, send)

    async def _too_large(self, send) -> None:
        await _answer(send, 413, f"request body larger than {self.max_bytes} bytes ({self.setting})",
                      [(b"connection", b"close")])


def _content_type_problem(headers: dict[bytes, bytes], expected: str = JSON) -> str | None:
    """Why a request's body cannot be read as ``expected`` (UTF-8) from its headers alone, or None (no body is
    fine)."""
    given = headers.get(b"content-type")
    if given is None:
        has_body = headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers
        return f"request body without a content type: send it as {expected}" if has_body else None
    text = given.decode("latin-1")
    media, *params = (part.strip().lower() for part in text.split(";"))
    charset = next((p.split("=", 1)[1].strip('"') for p in params if p.startswith("charset=")), "utf-8")
    if media != expected or charset not in ("utf-8", "utf8"):
        return f"content type {text[:100]!r} is not supported: send the body as {expected} (UTF-8)"
    return None


def _utf8_problem(body: bytes, expected: str) -> str | None:
    """Why ``body`` is not UTF-8 text, or None. A NUL byte counts: JSON text never holds one raw, and
    ``json.loads`` takes a body whose first bytes hold one for UTF-16 or UTF-32 and decodes it so."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as e:
        return (f"request body is not UTF-8 (byte 0x{body[e.start]:02x} at offset {e.start}): send it as {expected} "
                "encoded in UTF-8")
    if (nul := body.find(b"\x00")) >= 0:
        return (f"request body holds a NUL byte at offset {nul} (UTF-16 or UTF-32?): send it as {expected} encoded "
                "in UTF-8")
    return None


class _ObserveRequests:
    """Pure ASGI middleware (Starlette's BaseHTTPMiddleware costs about a millisecond per request, a
    large share of a small model's batched request): status from the response start, time to the end."""

    def __init__(self, app, metrics: ServiceMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status: int | None = None  # the status of the answer, once one is started

        async def send_observed(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_observed)
        except BaseException:
            status = status or 500  # an error that escaped every handler
            raise
        finally:
            # No answer started and nothing raised: the client went away first (e.g. in the middle of its body).
            self.metrics.observe(scope, status or CLIENT_CLOSED, time.perf_counter() - start)


def add_common_routes(app: FastAPI, metrics: ServiceMetrics, ready, protected: list[Any],
                      retry_after_s: int = 1, *, ready_means: str = "a model (or the metric registry) is loaded and "
                      "requests are accepted", auth_errors: OpenApiResponses | None = None) -> None:
    """``/healthz`` (GET and HEAD, no auth), ``/readyz`` and ``/metrics``; ``ready()`` says whether the app
    can serve: True, or False or the reason it cannot (a string), which a 503 from ``/readyz`` gives with
    the seconds to retry after (``retry_after_s``). ``ready_means`` is what readiness means for this app (its
    documentation); ``auth_errors`` the responses ``protected`` gives (default: a 401 for a bearer token)."""
    auth = (UNAUTHORIZED if auth_errors is None else auth_errors) if protected else {}

    async def healthz() -> Health:
        """Liveness: the process answers."""
        return Health(status="ok")

    app.add_api_route("/healthz", healthz, methods=["GET"], response_model=Health, tags=["ops"])
    app.add_api_route("/healthz", healthz, methods=["HEAD"], response_model=Health, tags=["ops"],
                      operation_id="healthz_head")

    @app.get("/readyz", response_model=Health, dependencies=protected, tags=["ops"],
             responses={**NOT_READY, **auth}, description=f"Readiness: {ready_means}.")
    async def readyz():
        state = ready()
        if state is not True:
            return JSONResponse({"detail": state or "not ready"}, status_code=503,
                                headers={"Retry-After": str(retry_after_s)})
        return Health(status="ready")

    # The exposition is text; the errors are JSON, as every route's (response_class=PlainTextResponse would
    # document them as text/plain).
    @app.get("/metrics", response_class=Response, dependencies=protected, tags=["ops"], responses={
        200: {"description": "Successful Response", "content": {CONTENT_TYPE_LATEST.split(";")[0]: {
            "schema": {"type": "string"}}}}, **auth})
    async def prometheus_metrics() -> Response:
        """Prometheus text exposition of this app's metrics."""
        return metrics.render()


def _printable(value: Any) -> Any:
    """``value`` with every string encodable as UTF-8: lone surrogates become ``\\udXXX`` text."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8") if LONE_SURROGATE.search(value) else value
    if isinstance(value, list | tuple):
        return [_printable(v) for v in value]
    if isinstance(value, dict):
        return {_printable(str(k)): _printable(v) for k, v in value.items()}
    return value


def _echo_safe(value: Any, depth: int = 0) -> Any:
    """What of a rejected input a 422 echoes: JSON-safe (NaN/inf as strings) and short."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, str):
        return value if len(value) <= 200 else value[:200] + "..."
    if depth > 4:
        return "..."
    if isinstance(value, list | tuple):
        return [_echo_safe(v, depth + 1) for v in value[:20]]
    if isinstance(value, dict):
        return {str(k): _echo_safe(v, depth + 1) for k, v in list(value.items())[:50]}
    return value


class ErrorJSONResponse(JSONResponse):
    """JSON error body that always encodes (see :func:`_printable`)."""

    def render(self, content: Any) -> bytes:
        return super().render(_printable(content))


def _readable(error: dict) -> dict:
    """A validation error as a client reads it: the union branch of a field named by what it is (``text``,
    ``list[text]``, not pydantic's ``constrained-str``), and a source of whitespace alone said in words (not as
    the regular expression it fails)."""
    loc = [part.replace("constrained-str", "text") if isinstance(part, str) else part for part in error["loc"]]
    msg = error["msg"]
    if error.get("type") == "string_pattern_mismatch" and error.get("ctx", {}).get("pattern") == r"\S":
        msg = "holds no text: whitespace alone (a source needs at least one token)"
    return {**error, "loc": loc, "msg": msg}


def install_error_handlers(app: FastAPI, metrics: ServiceMetrics | None = None) -> None:
    """422s in FastAPI's shape but safe to serialise; 503 + Retry-After for :class:`Overloaded`; nothing for
    a client that is gone; unexpected exceptions become a logged 500 with a JSON body (they are bugs: no
    input should reach one)."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's default handler echoes each bad input verbatim: a NaN or a lone surrogate there cannot be
        # serialised (a 500 for a bad request), and a 100k-character source would come straight back.
        errors = [{**_readable(e),
                   "input": _echo_safe(jsonable_encoder(e.get("input"), custom_encoder={float: _echo_safe})),
                   **({"ctx": _echo_safe(jsonable_encoder(e["ctx"], custom_encoder={float: _echo_safe}))}
                      if "ctx" in e else {})} for e in exc.errors()]
        return ErrorJSONResponse({"detail": errors}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400:
            # FastAPI's 400 for an unparseable body (not UTF-8, ...): a field error on `body` like any other.
            return ErrorJSONResponse({"detail": [{"type": "body_parse_error", "loc": ["body"],
                                                  "msg": str(exc.detail)}]}, status_code=422)
        return ErrorJSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Overloaded)
    async def overloaded(request: Request, exc: Overloaded) -> JSONResponse:
        if metrics is not None:
            metrics.rejected.inc()
        return ErrorJSONResponse({"detail": str(exc)}, status_code=503, headers={"Retry-After": str(exc.retry_after)})

    @app.exception_handler(TooSlow)
    async def too_slow(request: Request, exc: TooSlow) -> JSONResponse:
        if metrics is not None:
            metrics.rejected.inc()
        body = TooSlowResponse(detail=str(exc), predicted_s=round(exc.predicted_s, 3), limit_s=round(exc.limit_s, 3))
        return ErrorJSONResponse(body.model_dump(), status_code=429)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=CLIENT_CLOSED)  # never read: the metrics record it

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return ErrorJSONResponse({"detail": f"internal error: {type(exc).__name__}"}, status_code=500)


def _head_timeout_protocol(seconds: float) -> type:
    """uvicorn's HTTP protocol closing a connection whose request head has not arrived within ``seconds``
    of the connection or of its previous response (uvicorn waits for a head forever: a client that sends
    half of one, or nothing, would hold its connection open)."""

    class HeadTimeoutProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._in_request():  # a head arrived: the request is uvicorn's and the app's now
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next head has `seconds` from here (idle time included)

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _in_request(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(seconds, self._expired)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _expired(self) -> None:
            self._head_timer = None
            if not self._in_request() and not self.transport.is_closing():
                self.transport.close()

    return HeadTimeoutProtocol


def uvicorn_config(app, serve: ServeConfig, **kwargs: Any) -> uvicorn.Config:
    """uvicorn settings of both servers (``rlt2t serve`` and the deployed actor): the request-head timeout
    and the keep-alive timeout from ``serve``; ``kwargs`` go to ``uvicorn.Config`` as they are."""
    # uvicorn annotates timeout_keep_alive as int but only hands it to loop.call_later: seconds as a float work.
    return uvicorn.Config(app, http=_head_timeout_protocol(serve.header_timeout_s),
                          timeout_keep_alive=serve.keepalive_timeout_s, **kwargs)  # type: ignore[arg-type]
