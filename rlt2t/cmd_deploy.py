"""`rlt2t deploy up | status | down`: the training job and the policy server on a Ray cluster (see
``rlt2t.deploy``; `make deploy` / `make undeploy` call these). `serve-start` and `serve-stop` are run by the
launcher and teardown jobs on the cluster."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from rlt2t.cmd_common import load_cfg
from rlt2t.common.config import ConfigError


def cmd_deploy(args: argparse.Namespace) -> int:
    from rlt2t import deploy

    try:
        if args.deploy_command == "up":
            if not args.address:
                raise deploy.DeployError("address: set RAY_ADDRESS or --address (e.g. http://127.0.0.1:8265)")
            st = deploy.up(args.address, config_paths=args.config, overrides=args.overrides, python=args.python,
                           state_path=args.state, timeout_s=args.timeout, working_dir=args.working_dir,
                           name=args.name)
            print(f"dashboard:     {st.dashboard_url}")
            print(f"train job:     {st.train_job_id}   "
                  f"(ray job logs --address {st.dashboard_url} -f {st.train_job_id})")
            print(f"policy server: {st.server_url}")
            print(f"state:         {args.state}")
            return 0
        if args.deploy_command == "status":
            return deploy.status(args.address, state_path=args.state, wait=args.wait, timeout_s=args.timeout)
        if args.deploy_command == "down":
            deploy.down(args.address, state_path=args.state, python=args.python, timeout_s=args.timeout,
                        working_dir=args.working_dir, name=args.name)
            return 0
        if args.deploy_command == "serve-start":
            url = deploy.start_policy_server(load_cfg(args), name=args.name,
                                             timeout_s=args.timeout)
            print(f"{deploy.URL_MARKER}{url}", flush=True)
            return 0
        found = deploy.stop_policy_server(args.name)
        print(f"policy server {args.name!r} {'stopped' if found else 'was not running'}", flush=True)
        return 0
    except (deploy.DeployError, ConfigError) as e:
        print(f"rlt2t deploy {args.deploy_command}: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1  # a config error exits 2, as in every command (rlt2t.cli)


def register(sub: argparse._SubParsersAction, config_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add `deploy` and its subcommands to the `rlt2t` parser."""
    from rlt2t.deploy import DEFAULT_STATE, SERVER_NAME

    deploy = sub.add_parser("deploy", help="training job + policy server on the Ray cluster at RAY_ADDRESS")
    cmds = deploy.add_subparsers(dest="deploy_command", required=True, metavar="subcommand")

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                       help="dashboard address http://HOST:8265 (or ray://HOST:10001, HOST:6379); default RAY_ADDRESS")
        q.add_argument("--state", default=str(DEFAULT_STATE), help="state file written by up, read by status/down")
        q.set_defaults(fn=cmd_deploy)

    q = cmds.add_parser("up", help="submit the training job and start the policy server")
    common(q)
    config_args(q)
    q.add_argument("--python", default="python", help="interpreter of the jobs on the cluster (JOB_PYTHON)")
    q.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the server to be healthy")
    q.add_argument("--working-dir", default=None, type=_path,
                   help="directory uploaded with the jobs (default: this checkout, or the current directory)")
    q.add_argument("--name", default=SERVER_NAME,
                   help="name of the server actor (its placement group is NAME-pg); give each deployment on a "
                        "shared cluster its own")

    q = cmds.add_parser("status", help="job status and server health")
    common(q)
    q.add_argument("--wait", action="store_true", help="block until the training job ends; exit 1 if it failed")
    q.add_argument("--timeout", type=float, default=24 * 3600.0)

    q = cmds.add_parser("down", help="stop the job and the server")
    common(q)
    q.add_argument("--python", default=None, help="interpreter of the teardown job (default: the one of up)")
    q.add_argument("--timeout", type=float, default=120.0)
    q.add_argument("--working-dir", default=None, type=_path, help="directory uploaded with the teardown job")
    q.add_argument("--name", default=None,
                   help="server actor to stop when there is no state file (default: the one the state file "
                        f"records; without a state file nothing is stopped unless named, e.g. {SERVER_NAME})")

    # Run on the cluster by the launcher and teardown jobs.
    q = cmds.add_parser("serve-start", help="(run by the launcher job on the cluster) start the server actor")
    config_args(q)
    q.add_argument("--name", default=SERVER_NAME)
    q.add_argument("--timeout", type=float, default=300.0)
    q.set_defaults(fn=cmd_deploy)
    q = cmds.add_parser("serve-stop", help="(run by the teardown job on the cluster) stop the server actor")
    q.add_argument("--name", default=SERVER_NAME)
    q.set_defaults(fn=cmd_deploy)


def _path(text: str) -> Path:
    return Path(text)
