"""The policy server as a long-lived Ray actor: uvicorn serving ``create_app(cfg)`` in a background
thread. ``rlt2t deploy`` (``rlt2t.deploy``) launches it detached, in its own placement group; the class is
plain, ``ray.remote(...).options(...)`` is applied where it is launched."""

from __future__ import annotations

import threading

import httpx
import uvicorn

from rlt2t.common.config import Config
from rlt2t.common.waiting import NotYet, wait_until


def url_host(host: str) -> str:
    """``host`` as it goes in a URL (IPv6 literals in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def wait_healthy(url: str, timeout_s: float, *, interval_s: float = 0.5, error: type[Exception] = RuntimeError) -> None:
    """Poll ``url``/healthz until it answers 200; ``error`` after ``timeout_s``."""

    def healthy() -> None:
        try:
            status = httpx.get(f"{url}/healthz", timeout=5.0).status_code
        except httpx.HTTPError as e:
            raise NotYet(f"{type(e).__name__}: {e}") from None
        if status != 200:
            raise NotYet(f"HTTP {status}")

    wait_until(healthy, timeout_s=timeout_s, interval_s=interval_s, what=f"policy server {url} healthy", error=error)


class PolicyServerActor:
    """uvicorn on ``create_app(cfg)`` in a thread of this actor's process."""

    def __init__(self, cfg: Config, *, startup_timeout_s: float = 120.0):
        # The app (torch, transformers) is imported here, in the actor's process: the launcher and the CLI
        # import this module for url_host / wait_healthy only.
        from rlt2t.services.http import check_exposure, load_token, uvicorn_config
        from rlt2t.services.policy_app import create_app

        s = cfg.serve
        check_exposure(s, s.host, load_token(s))
        self._checkpoint_dir = str(cfg.path(s.checkpoint_dir))
        app = create_app(cfg, checkpoint_dir=self._checkpoint_dir)
        self._server = uvicorn.Server(uvicorn_config(app, s, host=s.host, port=s.port, log_level="info"))
        self._thread = threading.Thread(target=self._server.run, name="uvicorn", daemon=True)
        self._thread.start()

        def started() -> None:
            if not self._thread.is_alive():  # uvicorn exits its thread when it cannot bind
                raise RuntimeError(f"policy server failed to start on {s.host}:{s.port} (see this actor's log)")
            if not self._server.started:
                raise NotYet("uvicorn is starting")

        wait_until(started, timeout_s=startup_timeout_s, interval_s=0.05, what="policy server start",
                   error=RuntimeError)
        port = self._server.servers[0].sockets[0].getsockname()[1]  # the real one when serve.port=0
        host = s.host
        if host in ("0.0.0.0", "::", ""):
            import ray

            host = ray.util.get_node_ip_address()
        self._url = f"http://{url_host(host)}:{port}"
        # Health is checked from this process: the launcher job runs on the head, which cannot reach a
        # server bound to its own node's loopback (the default serve.host) on another node.
        local = "127.0.0.1" if s.host in ("0.0.0.0", "::", "", "localhost") or s.host.startswith("127.") else s.host
        self._local_url = f"http://{url_host(local)}:{port}"

    def url(self) -> str:
        return self._url

    def healthy_url(self, timeout_s: float) -> str:
        """The URL, once /healthz answers from this node (RuntimeError after ``timeout_s``)."""
        wait_healthy(self._local_url, timeout_s)
        return self._url

    def serving(self) -> str:
        """The checkpoint root this server watches (a redeploy must not reuse a server of another run)."""
        return self._checkpoint_dir

    def stop(self) -> None:
        """Let uvicorn finish in-flight requests and close its socket."""
        self._server.should_exit = True
        self._thread.join(timeout=30)
