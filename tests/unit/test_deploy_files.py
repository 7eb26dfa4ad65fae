"""deploy/ definitions (YAML structure, the Dockerfile's installs) and rlt2t.deploy's pure parts: no Ray."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from rlt2t.common.config import load_config
from rlt2t.deploy import (
    SERVER_NAME,
    URL_MARKER,
    DeployError,
    DeployState,
    parse_address,
    parse_server_url,
    read_state,
    serve_entrypoint,
    train_entrypoint,
    write_state,
)

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"


def _torch_pin() -> str:
    text = (REPO / "pyproject.toml").read_text()
    return re.search(r'"torch==([^"]+)"', text).group(1)


# --- cluster definitions ----------------------------------------------------------------------------------

def test_cluster_launcher_yaml_has_head_and_gpu_workers_and_installs_pinned_cuda_torch():
    cfg = yaml.safe_load((DEPLOY / "cluster-aws.yaml").read_text())
    assert cfg["provider"]["type"] == "aws"
    types = cfg["available_node_types"]
    assert cfg["head_node_type"] in types
    gpu = [name for name, t in types.items() if name != cfg["head_node_type"]]
    assert gpu, "a worker node type besides the head"
    worker = types[gpu[0]]
    assert re.match(r"(g4dn|g5|g6|g6e|p3|p4d|p5)\.", worker["node_config"]["InstanceType"])
    assert worker["max_workers"] >= worker["min_workers"] >= 0
    assert cfg["max_workers"] >= worker["max_workers"]
    setup = "\n".join(cfg["setup_commands"])
    assert f"torch=={_torch_pin()}" in setup and "download.pytorch.org/whl/" in setup
    assert re.search(r"pip install (-e )?~/rlt2t", setup), "the synced repo is installed"
    assert cfg["file_mounts"]["~/rlt2t"] == "."
    assert {".venv", "runs", ".git"} <= set(cfg["rsync_exclude"])
    assert any("ray start --head" in c for c in cfg["head_start_ray_commands"])
    assert any("--address=$RAY_HEAD_IP:6379" in c for c in cfg["worker_start_ray_commands"])


def test_kuberay_cluster_has_gpu_worker_group_on_the_project_image_and_shared_runs():
    docs = list(yaml.safe_load_all((DEPLOY / "kuberay" / "raycluster.yaml").read_text()))
    cluster = next(d for d in docs if d["kind"] == "RayCluster")
    pvc = next(d for d in docs if d["kind"] == "PersistentVolumeClaim")
    assert cluster["apiVersion"] == "ray.io/v1"
    assert cluster["spec"]["rayVersion"] == "2.60.0"
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    groups = cluster["spec"]["workerGroupSpecs"]
    gpu = next(g for g in groups if "nvidia.com/gpu" in g["template"]["spec"]["containers"][0]["resources"]["limits"])
    worker = gpu["template"]["spec"]["containers"][0]
    assert int(worker["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert gpu["minReplicas"] <= gpu["replicas"] <= gpu["maxReplicas"]
    assert head["image"] == worker["image"] and "rlt2t" in head["image"]
    for container in (head, worker):
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert "/mnt/rlt2t" in mounts
        assert {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"} <= {e["name"] for e in container["env"]}


def test_kuberay_job_runs_rlt2t_train_on_the_cluster():
    job = yaml.safe_load((DEPLOY / "kuberay" / "rayjob.yaml").read_text())
    cluster = next(d for d in yaml.safe_load_all((DEPLOY / "kuberay" / "raycluster.yaml").read_text())
                   if d["kind"] == "RayCluster")
    assert job["kind"] == "RayJob" and job["apiVersion"] == "ray.io/v1"
    assert job["spec"]["clusterSelector"]["ray.io/cluster"] == cluster["metadata"]["name"]
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:4] == ["python", "-m", "rlt2t.cli", "train"]
    overrides = [a for a in argv[4:] if "=" in a]
    cfg = load_config([], overrides)  # every override is a real config key with a valid value
    assert cfg.run.dir.startswith("/mnt/rlt2t/") and cfg.rl.learner_gpus >= 1
    assert isinstance(yaml.safe_load(job["spec"]["runtimeEnvYAML"]), dict)


def test_dockerfile_cuda_base_pinned_cuda_torch_then_project():
    text = (DEPLOY / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.replace("\\\n", " ").splitlines() if ln.strip() and not ln.startswith("#")]
    base = next(ln for ln in lines if ln.startswith("ARG BASE_IMAGE="))
    assert base.split("=", 1)[1].startswith("nvidia/cuda:")
    assert f"ARG TORCH_VERSION={_torch_pin()}" in lines
    runs = [ln for ln in lines if ln.startswith("RUN ")]
    torch_at = next(i for i, ln in enumerate(runs) if 'pip install "torch==${TORCH_VERSION}"' in ln)
    assert "--index-url \"https://download.pytorch.org/whl/${CUDA_TAG}\"" in runs[torch_at]
    project_at = next(i for i, ln in enumerate(runs) if re.search(r"pip install (--no-deps )?(-e )?\.", ln))
    assert torch_at < project_at, "CUDA torch must be installed before the project so the pin keeps it"
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    assert {".venv", "runs", ".git"} <= set(ignore)


# --- addresses ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "kind", "host", "port", "url", "loopback"), [
    ("http://127.0.0.1:8265", "dashboard", "127.0.0.1", 8265, "http://127.0.0.1:8265", True),
    ("https://ray.example.com", "dashboard", "ray.example.com", 8265, "https://ray.example.com:8265", False),
    ("localhost:9000", "dashboard", "localhost", 9000, "http://localhost:9000", True),
    ("10.0.0.5:6379", "gcs", "10.0.0.5", 6379, None, False),
    ("ray://10.0.0.5:10001", "client", "10.0.0.5", 10001, None, False),
    ("ray://head", "client", "head", 10001, None, False),
    ("http://[::1]:8265", "dashboard", "::1", 8265, "http://[::1]:8265", True),
])
def test_parse_address_forms(text, kind, host, port, url, loopback):
    a = parse_address(text)
    assert (a.kind, a.host, a.port, a.dashboard_url, a.is_loopback) == (kind, host, port, url, loopback)


@pytest.mark.parametrize("text", ["", "auto", "ftp://x:1", "justahost", "host:notaport", "host:70000", "http://:80"])
def test_parse_address_rejects_bad_input_naming_it(text):
    with pytest.raises(DeployError, match="address"):
        parse_address(text)


# --- state file and entrypoints -----------------------------------------------------------------------------

def test_state_roundtrip_and_missing_and_corrupt(tmp_path):
    path = tmp_path / "d" / "state.json"
    assert read_state(path) is None
    st = DeployState(dashboard_url="http://127.0.0.1:8265", run_dir="/r", train_job_id="j1",
                     server_url="http://127.0.0.1:9")
    write_state(path, st)
    assert read_state(path) == st
    assert not [p for p in path.parent.iterdir() if p.name != "state.json"], "no temporary file left"
    path.write_text("{not json")
    with pytest.raises(DeployError, match=str(path)):
        read_state(path)
    path.write_text('{"unexpected": 1}')
    with pytest.raises(DeployError, match="unreadable"):
        read_state(path)


def test_entrypoints_make_repo_configs_relative_and_quote_overrides(tmp_path):
    repo = tmp_path / "repo"
    (repo / "configs").mkdir(parents=True)
    inside, outside = repo / "configs" / "tiny.yaml", tmp_path / "elsewhere.yaml"
    overrides = ["run.dir=/shared/run", 'rl.rollout_resources={"fake_gpu": 1}']
    cmd = train_entrypoint("/opt/py", [inside, outside], overrides, repo)
    assert shlex.split(cmd) == ["/opt/py", "-m", "rlt2t.cli", "train", "--resume", "--config", "configs/tiny.yaml",
                                "--config", str(outside.resolve()), *overrides]
    serve = shlex.split(serve_entrypoint("python", [inside], overrides, repo, name=SERVER_NAME, timeout_s=30))
    assert serve[:5] == ["python", "-m", "rlt2t.cli", "deploy", "serve-start"]
    assert serve[-2:] == overrides and serve[serve.index("--name") + 1] == SERVER_NAME


def test_parse_server_url_takes_the_last_marker_line():
    logs = f"starting\n{URL_MARKER}http://10.0.0.1:1\nnoise\n(PolicyServerActor) {URL_MARKER}http://10.0.0.2:8000\n"
    assert parse_server_url(logs) == "http://10.0.0.2:8000"
    assert parse_server_url("no marker here") is None


def test_up_rejects_a_relative_run_dir_before_touching_the_cluster(tmp_path):
    from rlt2t.deploy import up

    with pytest.raises(DeployError, match="run.dir"):
        up("http://127.0.0.1:1", overrides=["run.dir=runs/x"], state_path=tmp_path / "s.json")
    assert not (tmp_path / "s.json").exists()


def _package_dirs_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("package_dirs", DEPLOY / "package_dirs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dockerfile_dependency_layer_creates_every_package_pyproject_lists(tmp_path):
    # The placeholders of the dependency layer: a package pyproject lists without its directory fails the
    # install ("package directory 'services/annotation' does not exist").
    import importlib
    import tomllib

    text = (DEPLOY / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.replace("\\\n", " ").splitlines() if ln.strip() and not ln.startswith("#")]
    deps_at = next(i for i, ln in enumerate(lines) if ln.startswith("RUN ") and 'pip install ".[test]"' in ln)
    assert "python deploy/package_dirs.py" in lines[deps_at].split("&&")[0]
    copied = " ".join(ln for ln in lines[:deps_at] if ln.startswith("COPY "))
    assert "deploy/package_dirs.py" in copied and "pyproject.toml" in copied

    (tmp_path / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    _package_dirs_script().main(["package_dirs.py", str(tmp_path)])
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert "rlt2t.services.annotation" in packages and "rlt2t.configs" in packages
    for package in packages:  # where the installed package's files are, in this checkout
        where = Path(importlib.import_module(package).__path__[0]).resolve().relative_to(REPO)
        assert (tmp_path / where / "__init__.py").is_file(), f"{package}: no {where}/__init__.py placeholder"


def test_the_docs_name_configs_that_ship_and_the_rl_stages_paths():
    docs = [REPO / "README.md", *sorted(p for p in DEPLOY.rglob("*") if p.is_file() and p.suffix in (".md", ".yaml"))]
    for doc in docs:
        text = doc.read_text()
        for name in re.findall(r"\bconfigs/[\w.-]+\.yaml\b", text):
            assert (REPO / name).is_file(), f"{doc.name} names {name}, which does not exist"
        # the RL stage writes rl/ (rlt2t.driver.STAGE); rank/ is only the name of runs made before the rename
        assert not re.search(r"runs/\w+/rank/|logs/rank/", text), f"{doc.name}: a rank/ path of the RL stage"
    gpu = load_config([REPO / "configs" / "gpu.yaml"]).run
    assert (gpu.device, gpu.mixed_precision) == ("cuda", "bf16")
