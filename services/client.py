"""Typed httpx clients of the policy and reward servers; methods mirror the routes.

    with PolicyClient("http://127.0.0.1:8000", token=os.environ.get("RLT2T_API_TOKEN")) as policy:
        out = policy.candidates(["12 7 33"], num_candidates=4, top_k=3, temperature=0.8)
        out.candidates[0][0].text, out.policy_version

Each client instance owns one pooled ``httpx.Client`` (``AsyncPolicyClient``: ``httpx.AsyncClient``);
use it as a context manager or call ``close()``. Requests are validated against the schema models
before they are sent, and responses parsed into them.

Retries (``retries`` extra attempts, exponential backoff with full jitter, ``backoff_s · 2^attempt``
capped at ``max_backoff_s``) happen only on transient failures: a connection that could not be made
(refused, DNS, connect timeout) and 503 (queue full / shutting down), where the server's Retry-After is
honoured up to ``max_retry_after_s``. Everything else raises at once: 4xx → :class:`RequestError`
(401 → :class:`AuthError`), other 5xx → :class:`ServerError`, a read timeout → :class:`ServiceTimeout`
(the server may still be working on it: not retried), and exhausted retries → :class:`Unavailable`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from rlt2t.services.schemas import (
    CandidatesRequest,
    CandidatesResponse,
    Health,
    ModelInfo,
    PairsRequest,
    PairsResponse,
    RewardMetrics,
    RewardRequest,
    RewardResponse,
    ScoreRequest,
    ScoreResponse,
)

log = logging.getLogger("rlt2t.services.client")

M = TypeVar("M", bound=BaseModel)

# Indirection so tests can replace the waits without patching the time/asyncio modules.
_sleep = time.sleep
_async_sleep = asyncio.sleep


class ServiceError(Exception):
    """A request to an rlt2t service failed; ``status`` is the HTTP status (None: no response)."""

    def __init__(self, message: str, *, status: int | None = None, detail: Any = None, url: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.detail = detail
        self.url = url


class RequestError(ServiceError):
    """The server rejected the request (4xx); ``detail`` is its error body (field errors for 422)."""


class AuthError(RequestError):
    """401: missing or wrong bearer token."""


class ServerError(ServiceError):
    """The server failed (5xx other than 503)."""


class Unavailable(ServiceError):
    """Retries exhausted: the server could not be reached or kept answering 503."""


class ServiceTimeout(ServiceError):
    """No response in time (not retried: the request may still be running on the server)."""


def _detail(response: httpx.Response) -> Any:
    try:
        body = response.json()
    except ValueError:
        return response.text[:2000]
    return body.get("detail", body) if isinstance(body, dict) else body


def _error_for(response: httpx.Response) -> ServiceError:
    detail = _detail(response)
    status = response.status_code
    url = str(response.request.url) if response.request is not None else ""
    message = f"{response.request.method} {url} → {status}: {detail}"
    if status == 401:
        return AuthError(message, status=status, detail=detail, url=url)
    if 400 <= status < 500:
        return RequestError(message, status=status, detail=detail, url=url)
    if status == 503:
        return Unavailable(message, status=status, detail=detail, url=url)
    return ServerError(message, status=status, detail=detail, url=url)


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date: fall back to our own backoff


class _Retrying:
    """Shared settings and decisions of the sync and async clients."""

    def __init__(self, base_url: str, *, token: str | None, timeout: float, connect_timeout: float, retries: int,
                 backoff_s: float, max_backoff_s: float, max_retry_after_s: float) -> None:
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        if timeout <= 0 or connect_timeout <= 0:
            raise ValueError(f"timeout and connect_timeout must be > 0, got {timeout}, {connect_timeout}")
        self.base_url = base_url.rstrip("/")
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_retry_after_s = max_retry_after_s
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout = httpx.Timeout(timeout, connect=connect_timeout)

    def delay(self, attempt: int, response: httpx.Response | None) -> float:
        """Seconds to wait before retry number ``attempt + 1``."""
        if response is not None and (after := _retry_after(response)) is not None:
            return min(after, self.max_retry_after_s) + random.uniform(0, self.backoff_s)
        return random.uniform(0, min(self.max_backoff_s, self.backoff_s * 2**attempt))

    @staticmethod
    def transient(exc: Exception) -> bool:
        # Only failures where the request surely did not run: no connection, or no pooled connection free.
        return isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout)

    def outcome(self, method: str, path: str, model: type[M], response: httpx.Response | None,
                exc: httpx.TransportError | None) -> M | Exception:
        """One attempt: the parsed result, or the error to retry on; raises what is not retried."""
        if exc is not None:
            if self.transient(exc):
                return exc
            if isinstance(exc, httpx.TimeoutException):
                raise ServiceTimeout(f"{method} {self.base_url}{path}: timed out: {exc}", url=path) from exc
            raise Unavailable(f"{method} {self.base_url}{path}: {type(exc).__name__}: {exc}", url=path) from exc
        assert response is not None
        if response.status_code != 503:
            return self.parse(response, model)
        return _error_for(response)

    def give_up(self, method: str, path: str, error: Exception) -> ServiceError:
        """The exception to raise once the retries are spent."""
        if isinstance(error, ServiceError):
            return error
        return Unavailable(f"{method} {self.base_url}{path}: {type(error).__name__}: {error} "
                           f"(after {self.retries} retries)", url=path)

    @staticmethod
    def parse(response: httpx.Response, model: type[M]) -> M:
        if response.status_code != 200:
            raise _error_for(response)
        try:
            return model.model_validate_json(response.content)
        except ValueError as e:
            raise ServerError(f"{response.request.url}: response does not match {model.__name__}: {e}",
                              status=response.status_code, url=str(response.request.url)) from e


def _body(model: type[BaseModel], fields: dict[str, Any]) -> dict[str, Any]:
    """Validate request fields client-side (a typo fails here, naming the field) and dump them."""
    return model(**fields).model_dump(mode="json", exclude_none=True)


def _references(references: Sequence[str | Sequence[str]]) -> list[str | list[str]]:
    """Per row its gold text or a list of its references, as the pairs and reward requests take them."""
    return [given if isinstance(given, str) else list(given) for given in references]


class _SyncBase(_Retrying):
    def __init__(self, base_url: str, *, token: str | None = None, timeout: float = 60.0, connect_timeout: float = 5.0,
                 retries: int = 3, backoff_s: float = 0.2, max_backoff_s: float = 5.0, max_retry_after_s: float = 10.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        super().__init__(base_url, token=token, timeout=timeout, connect_timeout=connect_timeout, retries=retries,
                         backoff_s=backoff_s, max_backoff_s=max_backoff_s, max_retry_after_s=max_retry_after_s)
        self._http = httpx.Client(base_url=self.base_url, headers=self.headers, timeout=self.timeout,
                                  transport=transport)

    def _request(self, method: str, path: str, model: type[M], json: dict[str, Any] | None = None) -> M:
        for attempt in range(self.retries + 1):
            response = exc = None
            try:
                response = self._http.request(method, path, json=json)
            except httpx.TransportError as e:  # timeouts included
                exc = e
            result = self.outcome(method, path, model, response, exc)
            if not isinstance(result, Exception):
                return result
            error = result
            if attempt == self.retries:
                break
            wait = self.delay(attempt, response)
            log.debug("%s %s: %s; retry %d/%d in %.2fs", method, path, error, attempt + 1, self.retries, wait)
            _sleep(wait)
        raise self.give_up(method, path, error) from (error if not isinstance(error, ServiceError) else None)

    def close(self) -> None:
        """Close the pooled connections."""
        self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def healthz(self) -> Health:
        return self._request("GET", "/healthz", Health)

    def readyz(self) -> Health:
        return self._request("GET", "/readyz", Health)


class _AsyncBase(_Retrying):
    def __init__(self, base_url: str, *, token: str | None = None, timeout: float = 60.0, connect_timeout: float = 5.0,
                 retries: int = 3, backoff_s: float = 0.2, max_backoff_s: float = 5.0, max_retry_after_s: float = 10.0,
                 transport: httpx.AsyncBaseTransport | None = None, max_connections: int = 100) -> None:
        super().__init__(base_url, token=token, timeout=timeout, connect_timeout=connect_timeout, retries=retries,
                         backoff_s=backoff_s, max_backoff_s=max_backoff_s, max_retry_after_s=max_retry_after_s)
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=self.headers, timeout=self.timeout,
                                       transport=transport,
                                       limits=httpx.Limits(max_connections=max_connections,
                                                           max_keepalive_connections=max_connections))

    async def _request(self, method: str, path: str, model: type[M], json: dict[str, Any] | None = None) -> M:
        for attempt in range(self.retries + 1):
            response = exc = None
            try:
                response = await self._http.request(method, path, json=json)
            except httpx.TransportError as e:  # timeouts included
                exc = e
            result = self.outcome(method, path, model, response, exc)
            if not isinstance(result, Exception):
                return result
            error = result
            if attempt == self.retries:
                break
            await _async_sleep(self.delay(attempt, response))
        raise self.give_up(method, path, error) from (error if not isinstance(error, ServiceError) else None)

    async def aclose(self) -> None:
        """Close the pooled connections."""
        await self._http.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def healthz(self) -> Health:
        return await self._request("GET", "/healthz", Health)

    async def readyz(self) -> Health:
        return await self._request("GET", "/readyz", Health)


class PolicyClient(_SyncBase):
    """Synchronous client of the policy server (`rlt2t serve policy`); a context manager.

        with rlt2t.PolicyClient("http://127.0.0.1:8000") as client:
            samples = client.candidates(["12 7 33"], num_candidates=4).candidates[0]
    """

    def candidates(self, sources: Sequence[str], **params: Any) -> CandidatesResponse:
        """POST /v1/candidates; ``params`` are the other ``CandidatesRequest`` fields (num_candidates, ...)."""
        body = _body(CandidatesRequest, {"sources": list(sources), **params})
        return self._request("POST", "/v1/candidates", CandidatesResponse, body)

    def pairs(self, sources: Sequence[str], references: Sequence[str | Sequence[str]], **params: Any) -> PairsResponse:
        """POST /v1/pairs; ``references``: per source its gold, or a list of its references (the first the gold);
        ``params`` are the other ``PairsRequest`` fields (example_ids, seed, ...)."""
        body = _body(PairsRequest, {"sources": list(sources), "references": _references(references), **params})
        return self._request("POST", "/v1/pairs", PairsResponse, body)

    def score(self, source: str, targets: Sequence[str]) -> ScoreResponse:
        """POST /v1/score: teacher-forced log-probs of ``targets`` given ``source``."""
        return self._request("POST", "/v1/score", ScoreResponse,
                             _body(ScoreRequest, {"source": source, "targets": list(targets)}))

    def model(self) -> ModelInfo:
        """GET /v1/model."""
        return self._request("GET", "/v1/model", ModelInfo)

    def reload(self) -> ModelInfo:
        """POST /v1/reload: serve the newest checkpoint on disk, even one older than the served one."""
        return self._request("POST", "/v1/reload", ModelInfo)


class AsyncPolicyClient(_AsyncBase):
    """Asynchronous client of the policy server (the methods of ``PolicyClient``, awaited).

        async with rlt2t.AsyncPolicyClient("http://127.0.0.1:8000") as client:
            samples = (await client.candidates(["12 7 33"])).candidates[0]
    """

    async def candidates(self, sources: Sequence[str], **params: Any) -> CandidatesResponse:
        body = _body(CandidatesRequest, {"sources": list(sources), **params})
        return await self._request("POST", "/v1/candidates", CandidatesResponse, body)

    async def pairs(self, sources: Sequence[str], references: Sequence[str | Sequence[str]],
                    **params: Any) -> PairsResponse:
        body = _body(PairsRequest, {"sources": list(sources), "references": _references(references), **params})
        return await self._request("POST", "/v1/pairs", PairsResponse, body)

    async def score(self, source: str, targets: Sequence[str]) -> ScoreResponse:
        return await self._request("POST", "/v1/score", ScoreResponse,
                                   _body(ScoreRequest, {"source": source, "targets": list(targets)}))

    async def model(self) -> ModelInfo:
        return await self._request("GET", "/v1/model", ModelInfo)

    async def reload(self) -> ModelInfo:
        return await self._request("POST", "/v1/reload", ModelInfo)


def _reward_body(candidates: Sequence[str], references: Sequence[str | Sequence[str]] | None,
                 metrics: Sequence[str] | None, sources: Sequence[str] | None) -> dict[str, Any]:
    fields: dict[str, Any] = {"candidates": list(candidates)}
    if references is not None:
        fields["references"] = _references(references)
    if sources is not None:
        fields["sources"] = list(sources)
    if metrics is not None:
        fields["metrics"] = list(metrics)
    return _body(RewardRequest, fields)


class RewardClient(_SyncBase):
    """Synchronous client of the reward server (`rlt2t serve reward`); a context manager.

        with rlt2t.RewardClient("http://127.0.0.1:8001") as client:
            scores = client.reward(["40 41"], references=["40 41 42"], metrics=["bleu4"]).scores["bleu4"]
    """

    def reward(self, candidates: Sequence[str], references: Sequence[str | Sequence[str]] | None = None,
               metrics: Sequence[str] | None = None, sources: Sequence[str] | None = None) -> RewardResponse:
        """POST /v1/reward: per-sample scores per metric (default: the task score). Reference metrics need
        ``references``; the server's named rewards (``reward.named``) need ``sources``."""
        return self._request("POST", "/v1/reward", RewardResponse,
                             _reward_body(candidates, references, metrics, sources))

    def metrics(self) -> RewardMetrics:
        """GET /v1/metrics: what ``metrics`` may name, the named rewards, and what this server does not offer
        (a metric whose data or package is missing here) with the command that installs it."""
        return self._request("GET", "/v1/metrics", RewardMetrics)


class AsyncRewardClient(_AsyncBase):
    """Asynchronous client of the reward server (the methods of ``RewardClient``, awaited).

        async with rlt2t.AsyncRewardClient("http://127.0.0.1:8001") as client:
            scores = (await client.reward(["40 41"], references=["40 41 42"])).scores
    """

    async def reward(self, candidates: Sequence[str], references: Sequence[str | Sequence[str]] | None = None,
                     metrics: Sequence[str] | None = None, sources: Sequence[str] | None = None) -> RewardResponse:
        return await self._request("POST", "/v1/reward", RewardResponse,
                                   _reward_body(candidates, references, metrics, sources))

    async def metrics(self) -> RewardMetrics:
        return await self._request("GET", "/v1/metrics", RewardMetrics)
