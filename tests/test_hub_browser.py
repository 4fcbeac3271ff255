"""The local Hub's pages in a real browser: headless Chromium (Debian's package; scripts/setup.sh installs it)
loads them from `tpu-kernels serve` holding the three built kernel repos. Each test asserts on the
DOM Chromium built and leaves a screenshot of the page in its temporary folder."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from huggingface_hub import HfApi

from .hub_support import (
    HOSTILE,
    KERNEL_NAMES,
    PRIVATE_REPO,
    REPO_ROOT,
    TOKEN,
    TRUSTED,
    active_content,
    loopback_only,
    publish_hostile_and_private_repos,
    publish_kernels,
    visible_text,
)

pytestmark = pytest.mark.browser

WINDOW = (1280, 1600)
BROWSER_TIMEOUT = 120
# As root without a desktop session; no traffic but to the page (this machine's network is closed).
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
    f"--window-size={WINDOW[0]},{WINDOW[1]}",
)


@pytest.fixture(scope="module")
def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("Chromium is not installed: `apt-get install chromium fonts-dejavu-core` (scripts/setup.sh installs it where it can)")
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`tpu-kernels serve` as a user runs it, with the three kernels, a hostile repo and a private one published."""
    folder = tmp_path_factory.mktemp("served")
    process = subprocess.Popen(
        [sys.executable, "-m", "tpu_kernels.cli", "serve", "--root", str(folder / "hub"), "--port", "0", "--quiet",
         "--trusted-org", TRUSTED],
        env=dict(os.environ, TPU_KERNELS_HUB_TOKEN=TOKEN), cwd=REPO_ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        banner = [process.stdout.readline() for _ in range(5)]
        browse = [line for line in banner if line.startswith("browse it: ")]
        assert browse, banner
        front_page = browse[0].removeprefix("browse it: ").strip()
        assert front_page.startswith("http://127.0.0.1:") and front_page.endswith("/"), banner
        with loopback_only(folder):
            published = publish_kernels(front_page.rstrip("/"), folder)
            publish_hostile_and_private_repos(HfApi(endpoint=published.url, token=TOKEN))
            yield published
    finally:
        process.terminate()
        process.wait(timeout=30)


def render(chromium: str, url: str, screenshot: Path, min_png_bytes: int = 30_000) -> str:
    """Load `url` in a fresh headless Chromium: the DOM it built, and a screenshot at `screenshot`."""
    with tempfile.TemporaryDirectory() as profile:
        result = subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--screenshot={screenshot}",
                                 "--dump-dom", url], capture_output=True, text=True, timeout=BROWSER_TIMEOUT,
                                stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-3000:]
    picture = screenshot.read_bytes()
    assert picture[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", picture[16:24]) == WINDOW
    # A blank window compresses to a few KiB; a page of text and tables does not.
    assert len(picture) > min_png_bytes, f"{screenshot} looks empty ({len(picture)} bytes)"
    assert active_content(result.stdout) == []
    return result.stdout


def test_front_page(chromium, served, tmp_path):
    text = visible_text(render(chromium, served.url + "/", tmp_path / "front.png"))
    assert f"{TRUSTED} trusted publisher" in text
    for name in KERNEL_NAMES:
        assert f"{TRUSTED}/{name} kernel v1 updated" in text
    assert f"{HOSTILE.repo} kernel v1 updated" in text
    assert PRIVATE_REPO not in text


@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_kernel_repo_page(chromium, served, tmp_path, name):
    repo, build = f"{TRUSTED}/{name}", served.builds[name]
    text = visible_text(render(chromium, f"{served.url}/kernels/{repo}", tmp_path / f"{name}.png"))
    commit = served.commits[repo]
    assert f"{repo} kernel trusted publisher showing v1 at {commit[:10]}" in text
    assert f'from kernels import get_kernel kernel = get_kernel("{repo}", version=1)' in text
    assert "v1 (metadata version 1) torch-cpu cpu, sha256 digest of" in text and f"cpu, tpu {commit[:10]}" in text
    card_title = (build / "README.md").read_text().split("\n# ", 1)[1].split("\n", 1)[0]
    assert f"Card license: apache-2.0 kernels tpu pallas" in text and f" {card_title} " in text
    assert "build/torch-tpu/metadata.json" in text and "build/torch-cpu/_binding.py" in text
    assert f"History of v1 {commit[:10]} Upload {name} v1 (torch-cpu, torch-tpu)" in text


def test_commit_page(chromium, served, tmp_path):
    repo = f"{TRUSTED}/ragged-dot-tpu"
    commit = served.commits[repo]
    text = visible_text(render(chromium, f"{served.url}/kernels/{repo}/commit/{commit}", tmp_path / "commit.png"))
    assert f"Upload ragged-dot-tpu v1 (torch-cpu, torch-tpu) {commit}" in text
    assert "added build/torch-cpu/gmm/kernel.py" in text and "added build/torch-tpu/gmm/kernel.py" in text


def test_hostile_content_is_inert_text(chromium, served, tmp_path):
    dom = render(chromium, f"{served.url}/kernels/{HOSTILE.repo}", tmp_path / "hostile.png")  # no active content
    assert f"<title>{HOSTILE.repo} · tpu-kernels hub</title>" in dom  # no script retitled the page
    text = visible_text(dom)
    for shown in ("Card <script>alert('card')</script>", """<img src=x onerror="alert('img')">""",
                  "<script>document.title = 'pwned'</script>", "[click me](javascript:alert('link'))",
                  HOSTILE.title, HOSTILE.path, " ".join(HOSTILE.message.split())):
        assert shown in text, shown


def test_private_repo_is_a_not_found_page_to_a_browser(chromium, served, tmp_path):
    text = visible_text(render(chromium, f"{served.url}/kernels/{PRIVATE_REPO}", tmp_path / "private.png",
                               min_png_bytes=5_000))
    assert f"404 Repository kernel/{PRIVATE_REPO} not found" in text and "secret" not in text.replace(PRIVATE_REPO, "")
