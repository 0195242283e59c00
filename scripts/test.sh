#!/usr/bin/env bash
# Sets up .venv (see setup.sh) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export MUJOCO_GL="${MUJOCO_GL:-disable}"
# Lint and import order first (configured in pyproject.toml): a finding fails the run.
.venv/bin/ruff check .
exec .venv/bin/python -m pytest tests "$@"
