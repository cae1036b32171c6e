#!/usr/bin/env bash
# Create or reuse the project's virtual environment (.venv) with every dependency pinned.
# Sourced by the other scripts; reinstalls only when requirements/, pyproject.toml, setup.py or the C kernels change
# (the install compiles mla_deploy/kernels' onnxruntime custom-op library).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
if [ ! -x "$venv/bin/python" ]; then
  echo "mla-deploy: creating $venv" >&2
  "${PYTHON:-python3}" -m venv "$venv"
fi
stamp="$venv/.mla-deploy-stamp"
want="$(cat "$root"/requirements/*.txt "$root/pyproject.toml" "$root/setup.py" "$root"/mla_deploy/kernels/*.[ch] \
  | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  echo "mla-deploy: installing pinned dependencies (first run takes a few minutes)" >&2
  "$venv/bin/python" -m pip install -q --upgrade pip "setuptools>=68"  # the build backend pyproject.toml names
  "$venv/bin/python" -m pip install -q -c "$root/requirements/lock.txt" -r "$root/requirements/dev.txt"
  "$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$root"
  echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
