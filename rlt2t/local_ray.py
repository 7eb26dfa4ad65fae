"""Stop one local Ray cluster, not every Ray on the machine: ``python -m rlt2t.local_ray stop TEMP_DIR``.

``ray stop`` ends every Ray process of the user on the machine, other people's clusters and jobs included.
A cluster started with ``ray start --temp-dir=DIR`` (``make ray-up`` uses ``RAY_TMP``) names ``DIR`` on the
command line of its processes (GCS, raylet, dashboard, workers through their session directory); this stops
those and their children: SIGTERM, then SIGKILL what is left after a grace period.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys

import psutil


def names_dir(arg: str, marker: str) -> bool:
    """True when a command-line argument is ``marker`` or a path inside it, alone or as ``--opt=<path>``;
    ``/tmp/rlt2t-ray`` does not name ``/tmp/rlt2t-ray-alice/...`` (another user's cluster)."""
    marker = marker.rstrip("/") or "/"
    values = [arg, arg.split("=", 1)[1]] if arg.startswith("-") and "=" in arg else [arg]
    return any(v == marker or v.startswith(marker + "/") for v in values)


def cluster_processes(marker: str) -> list[psutil.Process]:
    """Every process whose command line names ``marker`` (a cluster's temp dir, see :func:`names_dir`), with all
    their descendants; never this process or its ancestors (``make ray-down RAY_TMP=DIR`` names the dir too),
    nor a process this user may not signal (another user's: only root could stop it)."""
    found: dict[int, psutil.Process] = {}
    my_uids = {os.getuid(), os.geteuid()}
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(names_dir(arg, marker) for arg in p.info["cmdline"] or ()):
                for q in (p, *p.children(recursive=True)):
                    if _may_signal(q, my_uids):
                        found[q.pid] = q
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    me = psutil.Process()
    for p in (me, *me.parents()):
        found.pop(p.pid, None)
    return list(found.values())


def _may_signal(p: psutil.Process, my_uids: set[int]) -> bool:
    """What kill(2) allows: root anything, else a process whose real or saved uid is our real or effective one."""
    if 0 in my_uids:
        return True
    try:
        uids = p.uids()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    return bool(my_uids & {uids.real, uids.saved})


def stop_cluster(marker: str, grace_s: float = 5.0) -> int:
    """Stop the processes of the cluster whose temp dir is ``marker``; returns how many there were."""
    procs = cluster_processes(marker)
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            p.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            p.kill()
    psutil.wait_procs(alive, timeout=10)
    return len(procs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlt2t.local_ray", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    stop = sub.add_parser("stop", help="stop the local cluster started with --temp-dir=TEMP_DIR")
    stop.add_argument("temp_dir")
    args = ap.parse_args(argv)
    marker = os.path.abspath(args.temp_dir)
    if marker in ("/", os.path.abspath("/tmp")):
        ap.error(f"temp_dir {args.temp_dir!r} would match every Ray on the machine; give the cluster's own --temp-dir")
    n = stop_cluster(marker)
    print(f"stopped {n} processes of the Ray cluster in {marker}" if n else f"no Ray cluster running in {marker}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
