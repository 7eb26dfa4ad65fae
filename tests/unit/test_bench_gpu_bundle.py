"""bench/gpu_bundle.py: what it bundles for an offline GPU machine, and how it unpacks wheels (no network)."""

from __future__ import annotations

import stat
import zipfile

import pytest


@pytest.fixture
def bundle(bench_script):
    return bench_script("gpu_bundle")


def test_the_have_list_reads_names_versions_and_comments_and_names_a_bad_line(bundle, tmp_path):
    have = tmp_path / "have.txt"
    have.write_text("# the machine's packages\nTorch==2.11.0\n\npydantic_core  # a comment\nray[default]\n")
    assert bundle.read_have(have) == {"torch", "pydantic-core", "ray"}
    have.write_text("torch\nnot a name\n")
    with pytest.raises(SystemExit, match=r"have.txt:2: expected `name` or `name==version`"):
        bundle.read_have(have)


def test_the_closure_follows_requirements_as_installed_and_leaves_ray_s_extras(bundle):
    import importlib.metadata as md

    got = bundle.closure(["pydantic"], "3.12")
    assert got["pydantic"] == md.version("pydantic") and got["pydantic-core"] == md.version("pydantic-core")
    assert {"annotated-types", "typing-inspection", "typing-extensions"} <= set(got)
    ray = bundle.closure(["ray"], "3.12")
    assert "jsonschema" in ray and "aiohttp-cors" not in ray and "opencensus" not in ray  # no ray[default]
    with pytest.raises(SystemExit, match="not-a-package-here: required by the bundle but not installed here"):
        bundle.closure(["not-a-package-here"], "3.12")


def test_a_wheel_unpacks_as_pip_installs_it_without_what_no_gpu_run_needs(bundle, tmp_path):
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("demo/__init__.py", "x = 1\n")
        tool = zipfile.ZipInfo("demo/core/tool")
        tool.external_attr = (stat.S_IFREG | 0o755) << 16
        z.writestr(tool, "#!/bin/sh\n")
        z.writestr("demo-1.0.data/platlib/demo_ext.py", "y = 2\n")
        z.writestr("demo-1.0.data/scripts/demo", "#!/bin/sh\n")
        z.writestr("ray/jars/ray_dist.jar", "java")
        z.writestr("demo/static/main.js.map", "{}")
        z.writestr("demo-1.0.dist-info/METADATA", "Name: demo\n")
    site = tmp_path / "site"
    bundle.unpack([wheel], site)
    files = sorted(str(p.relative_to(site)) for p in site.rglob("*") if p.is_file())
    assert files == ["demo-1.0.dist-info/METADATA", "demo/__init__.py", "demo/core/tool", "demo_ext.py"]
    assert (site / "demo" / "core" / "tool").stat().st_mode & 0o111  # executables stay executable
