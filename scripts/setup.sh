#!/usr/bin/env bash
# Set up .venv/ at the repo root with everything the project and its tests need.
set -euo pipefail
cd "$(dirname "$0")/.."
python3.11 -m venv .venv 2>/dev/null || python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
# The exact CPU wheel first: a looser torch spec would pull a multi-GB CUDA build.
.venv/bin/pip install -q "torch==2.13.0"
.venv/bin/pip install -q -e ".[test]"
