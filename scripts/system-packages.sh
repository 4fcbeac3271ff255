#!/usr/bin/env bash
# The system packages the test suite needs beyond .venv/: Debian's Chromium (and a font for it to render
# text with) for the browser tests of the local Hub's pages (tests/test_hub_browser.py).
# Installed with apt-get when Chromium is missing and this shell can install (root, or passwordless sudo);
# otherwise this says what is missing and how to install it, and the rest of the setup goes on.
set -euo pipefail
packages=(chromium fonts-dejavu-core)
command -v chromium >/dev/null && exit 0

if [ "$(id -u)" = 0 ]; then
    as_root=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    as_root=(sudo -n)
else
    as_root=(cannot)
fi
if [ "${as_root[*]}" = cannot ] || ! command -v apt-get >/dev/null; then
    echo "setup: Chromium is missing, and the browser tests (tests/test_hub_browser.py) fail without it." >&2
    echo "setup: this shell cannot install it (that takes apt-get, and root or passwordless sudo). As root:" >&2
    echo "setup:     apt-get update && apt-get install --no-install-recommends ${packages[*]}" >&2
    exit 0
fi
echo "setup: installing Debian's ${packages[*]} for the browser tests"
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${packages[@]}"
