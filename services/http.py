"""What the policy and reward apps share: bearer-token auth, Prometheus metrics, error answers.

Auth: a token from ``serve.token_file`` (preferred) or the environment variable ``serve.token_env``;
when one is set every route but ``/healthz`` needs ``Authorization: Bearer <token>`` (compared in
constant time) and answers 401 otherwise. No token configured: no auth (the servers bind 127.0.0.1 by
default; bind elsewhere only with a token).

Metrics: each app owns a ``CollectorRegistry`` (tests create many apps in one process; the global
registry would refuse the second one's metric names).
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from rlt2t.common.config import ServeConfig
from rlt2t.services.schemas import ErrorResponse, Health

log = logging.getLogger("rlt2t.services.http")

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

UNAUTHORIZED = {401: {"model": ErrorResponse, "description": "Missing or wrong bearer token"}}
OVERLOADED = {503: {"model": ErrorResponse, "description": "Queue full or shutting down; retry after the "
                    "Retry-After header's seconds", "headers": {"Retry-After": {"schema": {"type": "integer"},
                                                                                "description": "seconds"}}}}
NOT_READY = {503: {"model": ErrorResponse, "description": "Not ready"}}


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
        return token
    return os.environ.get(serve.token_env, "").strip() or None


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


def auth_dependencies(token: str | None) -> list[Any]:
    """FastAPI dependencies for protected routes (none when no token is configured)."""
    if token is None:
        return []
    expected = token.encode("utf-8")
    scheme = HTTPBearer(auto_error=False, description="the server's bearer token")

    # A default, not Annotated[...]: with postponed annotations FastAPI could not see the local `scheme`.
    async def require_token(credentials: HTTPAuthorizationCredentials | None = Depends(scheme)) -> None:  # noqa: B008
        given = credentials.credentials.encode("utf-8") if credentials is not None else b""
        if credentials is None or not secrets.compare_digest(given, expected):
            raise HTTPException(401, "missing or invalid bearer token", headers={"WWW-Authenticate": "Bearer"})

    return [Depends(require_token)]


def field_error(loc: Sequence[str | int], msg: str, input_value: Any = None) -> RequestValidationError:
    """A 422 naming ``loc`` (e.g. ``("body", "sources", 3)``), in FastAPI's own validation-error shape."""
    return RequestValidationError([{"type": "value_error", "loc": tuple(loc), "msg": msg, "input": input_value}])


class ServiceMetrics:
    """Prometheus metrics of one app: requests by route and status, latency by route."""

    def __init__(self, prefix: str) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(f"{prefix}_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=self.registry)
        self.latency = Histogram(f"{prefix}_request_seconds", "Request latency by route", ["route"],
                                 buckets=LATENCY_BUCKETS, registry=self.registry)

    def install(self, app: FastAPI) -> None:
        """Count and time every request, labelled by its route template (never the raw path)."""
        app.add_middleware(_ObserveRequests, metrics=self)

    def observe(self, scope: dict, status: int, seconds: float) -> None:
        route = scope.get("route")
        # Unknown paths share one label: a scanner must not create one series per path it tries.
        label = getattr(route, "path", None) or "unmatched"
        self.requests.labels(label, str(status)).inc()
        self.latency.labels(label).observe(seconds)

    def render(self) -> Response:
        return PlainTextResponse(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class BodyLimit:
    """Pure ASGI middleware refusing bodies over ``max_bytes`` with 413, by Content-Length or while they
    stream in: FastAPI would otherwise read and parse a body before even checking the bearer token. The
    body (at most ``max_bytes``) is read here and replayed to the app."""

    def __init__(self, app, max_bytes: int, setting: str = "serve.max_body_bytes") -> None:
        self.app, self.max_bytes, self.setting = app, max_bytes, setting  # setting: named in the 413

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: let the app see it
                chunks = None
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        if chunks is None:
            await self.app(scope, receive, send)
            return
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: disconnect notifications

        await self.app(scope, replay, send)

    async def _refuse(self, send) -> None:
        body = json.dumps({"detail": f"request body larger than {self.max_bytes} bytes ({self.setting})"})
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body.encode()})


class _ObserveRequests:
    """Pure ASGI middleware (Starlette's BaseHTTPMiddleware costs about a millisecond per request, a
    large share of a small model's batched request): status from the response start, time to the end."""

    def __init__(self, app, metrics: ServiceMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), 500

        async def send_observed(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_observed)
        finally:
            self.metrics.observe(scope, status, time.perf_counter() - start)


def add_common_routes(app: FastAPI, metrics: ServiceMetrics, ready, protected: list[Any]) -> None:
    """``/healthz`` (no auth), ``/readyz`` and ``/metrics``; ``ready()`` says whether the app can serve."""

    @app.get("/healthz", response_model=Health, tags=["ops"])
    async def healthz() -> Health:
        """Liveness: the process answers."""
        return Health(status="ok")

    @app.get("/readyz", response_model=Health, dependencies=protected, tags=["ops"],
             responses={**NOT_READY, **(UNAUTHORIZED if protected else {})})
    async def readyz():
        """Readiness: a model (or the metric registry) is loaded and requests are accepted."""
        if not ready():
            return JSONResponse({"detail": "not ready"}, status_code=503)
        return Health(status="ready")

    @app.get("/metrics", response_class=PlainTextResponse, dependencies=protected, tags=["ops"],
             responses=UNAUTHORIZED if protected else {})
    async def prometheus_metrics() -> Response:
        """Prometheus text exposition of this app's metrics."""
        return metrics.render()


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


def install_error_handlers(app: FastAPI) -> None:
    """422s in FastAPI's shape but safe to serialise; unexpected exceptions become a logged 500 with a JSON
    body (they are bugs: no input should reach one)."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's default handler echoes each bad input verbatim: a NaN there cannot be serialised (a 500
        # for a bad request), and a 100k-character source would come straight back.
        errors = [{**e, "input": _echo_safe(jsonable_encoder(e.get("input"), custom_encoder={float: _echo_safe})),
                   **({"ctx": _echo_safe(jsonable_encoder(e["ctx"], custom_encoder={float: _echo_safe}))}
                      if "ctx" in e else {})} for e in exc.errors()]
        return JSONResponse({"detail": errors}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400:
            # FastAPI's 400 for an unparseable body (not UTF-8, ...): a field error on `body` like any other.
            return JSONResponse({"detail": [{"type": "body_parse_error", "loc": ["body"], "msg": str(exc.detail)}]},
                                status_code=422)
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return JSONResponse({"detail": f"internal error: {type(exc).__name__}"}, status_code=500)
