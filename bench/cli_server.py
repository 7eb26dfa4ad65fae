"""An `rlt2t ... serve` command in a subprocess, for the load benchmarks: started on a free loopback port and
stopped (SIGTERM, then SIGKILL after 30 s) by the benchmark itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class CliServer:
    """``python -m rlt2t.cli *args`` (or ``python *args`` with ``module=None``: a script of its own); ``url`` is
    the last word of its first stdout line, which must start with ``banner`` (the servers print
    ``serving <what> on <url>`` once they listen)."""

    def __init__(self, args: Sequence[str], banner: str, env: Mapping[str, str] | None = None,
                 module: str | None = "rlt2t.cli") -> None:
        command = [sys.executable, *(["-m", module] if module else []), *args]
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     env=dict(env or os.environ), cwd=REPO)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith(banner):
            self.stop()
            raise RuntimeError(f"server did not start (exit {self.proc.poll()}): {line!r}")
        self.url = line.split()[-1]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
