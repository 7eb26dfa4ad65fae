"""`rlt2t serve ...` subcommands (registered by rlt2t.cli): the policy and reward HTTP servers.

    rlt2t serve policy [--checkpoint-dir DIR] [--host H] [--port P] [--document-frequency FILE] [overrides]
    rlt2t serve reward [--host H] [--port P] [--document-frequency FILE] [overrides]

Once the model is loaded and the socket listens, one line ``serving policy on http://HOST:PORT`` (the
real port when 0 was asked for) goes to stdout, flushed: scripts wait for it and parse the URL.
SIGTERM and Ctrl-C stop the server gracefully (in-flight requests finish) and exit 0. Connection
timeouts (request head, body, idle keep-alive) come from ``serve.*_timeout_s`` (``rlt2t.services.http``).
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
from collections.abc import Callable

from rlt2t.cmd_common import load_cfg

log = logging.getLogger("rlt2t.services.serve")


def _listening_socket(host: str, port: int) -> socket.socket:
    """Bind and listen before uvicorn starts, so the printed port is real and connections queue at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    sock.listen(2048)
    return sock


def run_server(app, host: str, port: int, name: str, serve=None) -> None:
    """Serve ``app`` with uvicorn until SIGTERM / Ctrl-C; prints ``serving NAME on URL`` once listening.
    ``serve`` (a ServeConfig; default: the defaults) gives the connection timeouts."""
    import uvicorn

    from rlt2t.common.config import ServeConfig
    from rlt2t.services.deploy_actor import url_host
    from rlt2t.services.http import uvicorn_config

    class _Server(uvicorn.Server):
        # uvicorn re-raises a caught SIGTERM/SIGINT after its graceful shutdown, which would kill the
        # process with the signal (or a KeyboardInterrupt) instead of a clean exit 0.
        def handle_exit(self, sig: int, frame) -> None:
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    sock = _listening_socket(host, port)
    actual_host, actual_port = sock.getsockname()[:2]
    config = uvicorn_config(app, serve or ServeConfig(), log_level="info", access_log=False,
                            timeout_graceful_shutdown=30, lifespan="on")
    server = _Server(config)
    print(f"serving {name} on http://{url_host(actual_host)}:{actual_port}", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    log.info("%s server stopped", name)


def _document_frequency(cfg, given: str | None) -> str | None:
    """--document-frequency, else the run's own table (written by rank training) when it exists."""
    if given is not None:
        return given
    default = cfg.run_dir / "rl" / "document_frequency.json"
    if default.is_file():
        log.info("CIDEr-D document frequencies from %s (the run's training references)", default)
        return str(default)
    log.info("no --document-frequency and no %s: CIDEr-D document frequencies come from each request's "
             "references", default)
    return None


def _serve(args, name: str, make_app: Callable, port_setting: str) -> None:
    """What both servers do: load the config, refuse to listen beyond loopback without a token, build the app
    (``make_app(cfg, document_frequency)``) and serve it on ``--port``, else ``serve.<port_setting>``."""
    from rlt2t.services.http import check_exposure, load_token

    cfg = load_cfg(args)
    host = args.host or cfg.serve.host
    check_exposure(cfg.serve, host, load_token(cfg.serve))
    app = make_app(cfg, _document_frequency(cfg, args.document_frequency))
    run_server(app, host, getattr(cfg.serve, port_setting) if args.port is None else args.port, name, cfg.serve)


def cmd_serve_policy(args) -> None:
    from rlt2t.services.policy_app import create_app

    _serve(args, "policy", lambda cfg, df: create_app(cfg, checkpoint_dir=args.checkpoint_dir, document_frequency=df),
           "port")


def cmd_serve_reward(args) -> None:
    from rlt2t.services.reward_app import create_app

    _serve(args, "reward", lambda cfg, df: create_app(cfg, document_frequency=df), "reward_port")


def register(sub: argparse._SubParsersAction, config_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add this module's subcommands to the `rlt2t` parser; `config_args` adds --config and overrides."""
    serve = sub.add_parser("serve", help="HTTP servers: policy (candidates, pairs, scores) and reward").add_subparsers(
        dest="serve_command", required=True, metavar="subcommand")

    p = serve.add_parser("policy", help="serve a policy checkpoint (hot-reloads newer complete checkpoints)")
    config_args(p)
    p.add_argument("--checkpoint-dir", default=None,
                   help="checkpoint root or model directory (default: serve.checkpoint_dir)")
    p.add_argument("--host", default=None, help="bind address (default: serve.host, 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default: serve.port; 0: any free port)")
    p.add_argument("--document-frequency", default=None, metavar="FILE",
                   help="CIDEr-D document frequencies for /v1/pairs (default: {run}/rl/document_frequency.json "
                        "when it exists, else each request's references)")
    p.set_defaults(fn=cmd_serve_policy)

    p = serve.add_parser("reward", help="serve metric scores (/v1/reward)")
    config_args(p)
    p.add_argument("--host", default=None, help="bind address (default: serve.host, 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default: serve.reward_port; 0: any free port)")
    p.add_argument("--document-frequency", default=None, metavar="FILE",
                   help="CIDEr-D document frequencies (default: {run}/rl/document_frequency.json when it exists, "
                        "else each request's references)")
    p.set_defaults(fn=cmd_serve_reward)
