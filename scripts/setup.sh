#!/usr/bin/env bash
# Set up everything the README's commands need: .venv/ at the repo root with the project and its test
# extras, and the system packages of the test suite (scripts/system-packages.sh: Chromium).
set -euo pipefail
cd "$(dirname "$0")/.."
python3.11 -m venv .venv 2>/dev/null || python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
# The exact CPU wheel first: a looser torch spec would pull a multi-GB CUDA build.
.venv/bin/pip install -q "torch==2.13.0"
.venv/bin/pip install -q -e ".[test]"
# Every installed requirement satisfied (transformers 5.25 pins kernels >=0.19.1,<0.20): a conflict stops here.
.venv/bin/pip check
scripts/system-packages.sh
