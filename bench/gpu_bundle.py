"""Pack the Python packages an offline GPU machine lacks for bench/gpu.py and tests/gpu into one file.

    python bench/gpu_bundle.py --have bench/machines/h200-packages.txt            # -> .device/site.tar.xz
    python bench/gpu_bundle.py --have FILE --python-version 3.11 --out /tmp/x.tar.xz   # this machine's Python

For a GPU machine that has Python, a CUDA build of torch and the common ML packages but cannot reach a package
index, and takes files up to a size limit (the device machines lent to this project: 64 MiB with the working
tree). Run it here, where pip reaches the registry; on the GPU machine, bench/gpu_device.sh unpacks the file and
installs the working tree beside it.

What goes in: the packages bench/gpu.py and tests/gpu import (ROOTS) and their requirements, recursively, as
installed in this environment (same versions), minus the names listed in --have (one per line, `name` or
`name==version`, `#` comments: `pip list --format=freeze` on the GPU machine gives it). The GPU machine's own
torch, transformers and the rest stay its own, whatever their versions. Wheels are fetched for the target's
Python (--python-version) and Linux x86-64, unpacked as pip would install them, then slimmed: Ray's Java worker
jar and the dashboard's source maps are dropped, and debug symbols are stripped from ELF files (`strip
--strip-debug`, where `strip` exists). A package with no wheel for the target (a pure-Python sdist) is built
into a wheel here first.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]

ROOTS = {
    "pydantic": "every config (rlt2t.common.config)",
    "ray": "the end-to-end job and the two-GPU tests (Ray core alone: no dashboard, so no extras)",
    "ctranslate2": "the rollout part and the learner's CTranslate2 rollouts",
    "fastapi": "tests/conftest.py imports the services' HTTP layer",
    "uvicorn": "tests/conftest.py's live server",
    "pyyaml": "config files",
    "sacrebleu": "BLEU in the reward workers",
    "rouge-score": "rlt2t.common.metrics imports ROUGE and, through it, NLTK (METEOR) at import",
    "peft": "LoRA (the sharded LoRA tests)",
    "accelerate": "the SFT stages' loop",
    "psutil": "the learner's memory figures",
    "tqdm": "progress lines",
    "rich": "the CLI's tables",
}
"""The distributions the GPU benchmark and tests import, and what for; everything else of rlt2t's runtime
(the annotation database, Hugging Face datasets, Ray's dashboard) is left out."""

NO_EXTRAS = {"ray"}
"""Requirements followed without their extras (ray[default] would pull the dashboard's stack)."""

DROP = ("ray/jars/", ".js.map")
"""Files no GPU run needs (Java workers; browser source maps), by path prefix or suffix inside the site."""


def read_have(path: Path) -> set[str]:
    names = set()
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name = line.split("==", 1)[0].split("[", 1)[0].strip()
        if not name or any(c.isspace() for c in name):
            raise SystemExit(f"{path}:{n}: expected `name` or `name==version`, got {line!r}")
        names.add(canonicalize_name(name))
    return names


def closure(roots: list[str], python_version: str) -> dict[str, str]:
    """{canonical name: installed version} of ``roots`` and their runtime requirements, markers evaluated for
    CPython ``python_version`` on Linux x86-64."""
    env = {"python_version": python_version, "python_full_version": f"{python_version}.0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython"}
    found: dict[str, str] = {}

    def walk(name: str, extras: tuple[str, ...]) -> None:
        key = canonicalize_name(name)
        if key in found:
            return
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            raise SystemExit(f"{name}: required by the bundle but not installed here (make .venv first)") from None
        found[key] = dist.version
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker and not any(req.marker.evaluate({**env, "extra": e}) for e in extras or ("",)):
                continue
            walk(req.name, () if canonicalize_name(req.name) in NO_EXTRAS else tuple(req.extras))

    for root in roots:
        walk(root, ())
    return found


def fetch(pins: dict[str, str], python_version: str, dest: Path) -> list[Path]:
    """The wheels of ``pins`` for the target into ``dest`` (a pure-Python sdist is built into a wheel here)."""
    platforms = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_27_x86_64",
                 "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "linux_x86_64"]
    base = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(dest)]
    target = ["--only-binary=:all:", "--implementation", "cp", "--python-version", python_version,
              *(x for p in platforms for x in ("--platform", p))]
    for name, version in sorted(pins.items()):
        spec = f"{name}=={version}"
        got = subprocess.run([*base, *target, spec], capture_output=True, text=True)
        if got.returncode != 0:  # no wheel for the target: a pure-Python sdist, built here
            built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(dest),
                                    spec], capture_output=True, text=True)
            if built.returncode != 0:
                raise SystemExit(f"{spec}: no wheel for CPython {python_version} on Linux x86-64 and no "
                                 f"buildable sdist:\n{got.stderr[-1500:]}\n{built.stderr[-1500:]}")
        print(f"  {spec}", flush=True)
    return sorted(dest.glob("*.whl"))


def unpack(wheels: list[Path], site: Path) -> None:
    """Each wheel's files as pip would install them into site-packages (``*.data/purelib|platlib`` moved up;
    its scripts and headers left out), executables kept executable."""
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                parts = info.filename.split("/")
                if parts[0].endswith(".data"):
                    if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                        continue
                    parts = parts[2:]
                rel = "/".join(parts)
                if info.is_dir() or rel.startswith(DROP) or rel.endswith(DROP):
                    continue
                out = site / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                with z.open(info) as src, out.open("wb") as dst:
                    shutil.copyfileobj(src, dst)
                mode = (info.external_attr >> 16) & 0o777
                if mode:
                    out.chmod(mode)


def strip_debug(site: Path) -> int:
    """Bytes saved by ``strip --strip-debug`` on the ELF files over 1 MB (0 without `strip`)."""
    strip = shutil.which("strip")
    if strip is None:
        print("  no `strip` here: debug symbols kept", flush=True)
        return 0
    saved = 0
    for path in site.rglob("*"):
        if not path.is_file() or path.is_symlink() or path.stat().st_size < 1 << 20:
            continue
        with path.open("rb") as f:
            if f.read(4) != b"\x7fELF":
                continue
        before = path.stat().st_size
        if subprocess.run([strip, "--strip-debug", str(path)], capture_output=True).returncode == 0:
            saved += before - path.stat().st_size
    return saved


def size_of(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--have", type=Path, required=True,
                    help="the GPU machine's installed distributions, one per line (pip list --format=freeze)")
    ap.add_argument("--python-version", default="3.12", help="the GPU machine's Python, major.minor (default 3.12)")
    ap.add_argument("--out", type=Path, default=REPO / ".device" / "site.tar.xz",
                    help="the bundle to write (default .device/site.tar.xz, which git ignores)")
    ap.add_argument("--limit-mib", type=float, default=64.0,
                    help="warn when the bundle and the tracked tree together exceed this (default 64)")
    args = ap.parse_args(argv)
    have = read_have(args.have)
    pins = {k: v for k, v in closure(sorted(ROOTS), args.python_version).items() if k not in have}
    print(f"{len(pins)} distributions to bundle for CPython {args.python_version} (not in {args.have}):",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="rlt2t-bundle-") as tmp:
        wheels = fetch(pins, args.python_version, Path(tmp) / "wheels")
        site = Path(tmp) / "site"
        unpack(wheels, site)
        unpacked = size_of(site)
        saved = strip_debug(site)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        partial = args.out.with_name(args.out.name + ".partial")
        with tarfile.open(partial, "w:xz", preset=6) as tar:
            tar.add(site, arcname="site")
        os.replace(partial, args.out)
    tree = sum((REPO / f).stat().st_size for f in subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split("\0")
        if f and (REPO / f).is_file())
    mib = args.out.stat().st_size / 2**20
    print(f"{args.out}: {mib:.1f} MiB ({unpacked / 2**20:.0f} MiB unpacked, {saved / 2**20:.0f} MiB of debug "
          f"symbols stripped); with the tracked tree ({tree / 2**20:.1f} MiB) {mib + tree / 2**20:.1f} MiB")
    if mib + tree / 2**20 > args.limit_mib:
        print(f"WARNING: over --limit-mib {args.limit_mib:g}: leave a root out of ROOTS or carry it separately",
              file=sys.stderr)


if __name__ == "__main__":
    main()
