#!/usr/bin/env bash
# Set up everything the README's commands need: .venv/ at the repo root with the project and its test
# extras, and the system packages of the test suite (scripts/system-packages.sh: Chromium).
set -euo pipefail
cd "$(dirname "$0")/.."
python3.11 -m venv .venv 2>/dev/null || python3 -m venv .venv
# uv installs what pip would in two thirds of pip's CPU time, and byte-compiles on every core. It runs
# from a throwaway folder: .venv/ holds what pip alone put there.
uv_dir=$(mktemp -d)
trap 'rm -rf "$uv_dir"' EXIT
.venv/bin/pip install -q --target "$uv_dir" "uv>=0.13,<0.14"
# pip picks the torch wheel, as this machine's pip configuration says (find-links, indexes, constraints:
# uv reads none of it); here that is the local CPU wheel. The exact version: a looser spec would pull a
# multi-GB CUDA build.
torch_wheel=$(.venv/bin/pip install -q --dry-run --ignore-installed --no-deps --report - "torch==2.13.0" |
    .venv/bin/python -c 'import json, sys; print(json.load(sys.stdin)["install"][0]["download_info"]["url"])')
# --compile-bytecode, as pip does: otherwise every test process compiles what it imports, again and again.
# --system-certs: the certificates pip trusts (a proxy's own, say), not only uv's bundled ones.
"$uv_dir/bin/uv" pip install -q --python .venv/bin/python --compile-bytecode --system-certs \
    --upgrade-package pip "torch @ $torch_wheel" -e ".[test]" pip
# Every installed requirement satisfied (transformers 5.25 pins kernels >=0.19.1,<0.20): a conflict stops here.
.venv/bin/pip check
scripts/system-packages.sh
