"""What `pip install .` (not editable) gives a user: the package built as a wheel and installed on its own, with the
bundled demo model, the presets and the kernel library inside, exporting and generating from an empty directory."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The project's wheel, installed with `pip --target` into a directory of its own (its dependencies are the
    test environment's); returns (site directory, environment that imports mla_deploy from there only)."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"  # a copy: a build/ directory left in the checkout would feed the wheel stale files
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "benchmarks",
                                                                "__pycache__", "*.so", "out", "exports", "mutants"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(work / "dist"), str(source)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    wheel = next((work / "dist").glob("mla_deploy-*.whl"))
    site = work / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                              str(wheel)], capture_output=True, text=True)
    assert install.returncode == 0, install.stderr
    env = {**os.environ, "PYTHONPATH": str(site)}  # ahead of the editable install's finder
    return wheel, site, env


def test_the_wheel_carries_the_demo_model_presets_and_kernels(installed):
    wheel, _, _ = installed
    names = zipfile.ZipFile(wheel).namelist()
    for name in ("mla_deploy/models/demo/model.safetensors", "mla_deploy/models/demo/tokenizer.json",
                 "mla_deploy/models/demo/config.json", "mla_deploy/models/presets/v2lite.json"):
        assert name in names
    assert any(n.startswith("mla_deploy/kernels/_kernels") for n in names)


def test_an_installed_wheel_exports_and_runs_the_demo_from_anywhere(installed, tmp_path):
    _, site, env = installed
    cli = [sys.executable, "-m", "mla_deploy.cli"]
    where = subprocess.run([sys.executable, "-c", "import mla_deploy; print(mla_deploy.__file__)"], cwd=tmp_path,
                           env=env, capture_output=True, text=True)
    assert where.stdout.strip().startswith(str(site)), where.stdout  # the wheel's copy, not the checkout
    export = subprocess.run([*cli, "export", "-o", "demo", "--steps", "2"], cwd=tmp_path, env=env,
                            capture_output=True, text=True)
    assert export.returncode == 0, export.stderr
    run = subprocess.run([*cli, "run", "demo", "--prompt", "def ", "-n", "8", "--temperature", "0", "--json"],
                         cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert len(json.loads(run.stdout)["token_ids"]) == 8
    preset = subprocess.run([*cli, "preset", "tiny-v3", "-o", "tiny"], cwd=tmp_path, env=env, capture_output=True,
                            text=True)
    assert preset.returncode == 0, preset.stderr
