"""deploy/Dockerfile: hadolint clean, and in step with the Helm chart and its build context.

Building the image needs a container daemon and the CUDA base image, which CI does not have; see
deploy/cluster.md and the issue notes for the build that was run by hand.
"""
from __future__ import annotations

import re
import subprocess
import sysconfig
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"


@pytest.fixture(scope="module")
def hadolint() -> Path:
    out = subprocess.run(["bash", str(ROOT / "helm" / "tools" / "install.sh")], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    return Path(sysconfig.get_path("scripts")) / "hadolint"


def stages() -> list[list[str]]:
    """Instructions of each build stage, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            out.append([])
        if out:
            out[-1].append(line)
    return out


def test_dockerfile_lints_clean(hadolint):
    out = subprocess.run([str(hadolint), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_image_user_is_the_charts_non_root_uid():
    *_, final = stages()
    users = [line.split()[1] for line in final if line.upper().startswith("USER ")]
    uid, _, gid = users[-1].partition(":")
    values = yaml.safe_load((ROOT / "helm" / "pulse" / "values.yaml").read_text())["podSecurityContext"]
    assert uid != "0" and (int(uid), int(gid)) == (values["runAsUser"], values["runAsGroup"])


def test_build_context_holds_everything_the_build_copies():
    ignore = (ROOT / "deploy" / "Dockerfile.dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    copied = set()
    for stage in stages():
        for line in stage:
            parts = line.split()
            if parts[0].upper() == "COPY" and not any(p.startswith("--from") for p in parts):
                copied.update(p.rstrip("/") for p in parts[1:-1] if not p.startswith("--"))
    assert copied and copied <= allowed, copied - allowed
    # Every top-level package pyproject installs is copied in.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages <= copied, packages - copied
    # ... and what deploy/build_llama_server.sh sources, runs or applies from beside itself ("$HERE"/NAME)
    script = (ROOT / "deploy" / "build_llama_server.sh").read_text()
    beside = {"deploy/" + m for m in re.findall(r'"\$HERE"?/(\w[\w.]*)', script)}
    assert {"deploy/llama_isa.sh", "deploy/check_llama_server.py", "deploy/llama_patches"} <= beside, beside
    assert beside <= copied, beside - copied
