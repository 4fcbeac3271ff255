"""The local Hub's web pages as HTML over HTTP (test_hub_browser.py renders them in Chromium): what
they show, that user content stays inert, and that private repos stay hidden."""

from __future__ import annotations

import hashlib
import json
import re

from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi
from huggingface_hub.utils import get_session

from tpu_kernels.distribution.hub.pages import CONTENT_SECURITY_POLICY

from .hub_support import (
    HOSTILE,
    KERNEL_NAMES,
    PRIVATE_REPO,
    TOKEN,
    TRUSTED,
    active_content,
    png,
    publish_hostile_and_private_repos,
    published_fixture,
    visible_text,
)


def publish_page_content(api: HfApi) -> None:
    publish_hostile_and_private_repos(api)
    # A second version and a tag, so the page has more than one of each to show.
    api.create_branch(f"{TRUSTED}/rmsnorm-tpu", repo_type="kernel", branch="v2", revision="v1")
    api.create_tag(f"{TRUSTED}/rmsnorm-tpu", repo_type="kernel", tag="first-release", revision="v1")


published = published_fixture("hub-pages", publish_page_content)


def get(url: str, token: str | None = None, method: str = "GET"):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return get_session().request(method, url, headers=headers, follow_redirects=False)


def page(published, path: str, status: int = 200, token: str | None = None) -> str:
    response = get(published.url + path, token)
    assert response.status_code == status, response.text[:2000]
    assert response.headers["content-type"] == "text/html; charset=utf-8"
    assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert active_content(response.text) == []
    return response.text


def test_front_page_lists_namespaces_and_repos_and_marks_trusted_publishers(published):
    text = visible_text(page(published, "/"))
    assert f"{TRUSTED} trusted publisher" in text
    for name in KERNEL_NAMES:
        assert f"{TRUSTED}/{name} kernel {'v2 v1' if name == 'rmsnorm-tpu' else 'v1'} updated" in text
    assert "mallory " in text and "mallory trusted publisher" not in text
    assert PRIVATE_REPO not in text


def test_private_repos_appear_only_with_the_token(published):
    assert PRIVATE_REPO in visible_text(page(published, "/", token=TOKEN))
    assert "private" in visible_text(page(published, f"/kernels/{PRIVATE_REPO}", token=TOKEN))
    commit = HfApi(endpoint=published.url, token=TOKEN).kernel_info(PRIVATE_REPO).sha
    for path in (f"/kernels/{PRIVATE_REPO}", f"/kernels/{PRIVATE_REPO}/tree/main",
                 f"/kernels/{PRIVATE_REPO}/commit/{commit}"):
        html = page(published, path, status=404)
        assert "secret" not in html.replace(PRIVATE_REPO, "")
        assert f"Repository kernel/{PRIVATE_REPO} not found" in visible_text(html)


def test_repo_page_shows_versions_variants_tags_card_files_history_and_snippet(published):
    repo = f"{TRUSTED}/rmsnorm-tpu"
    text = visible_text(page(published, f"/kernels/{repo}"))
    commit = published.commits[repo]
    assert f"showing v2 at {commit[:10]}" in text
    assert f'kernel = get_kernel("{repo}", version=2)' in text
    versions = text[text.index("Versions"):text.index("Tags")]
    digested = {backend: len(json.loads((published.builds["rmsnorm-tpu"] / "build" / f"torch-{backend}" /
                                         "metadata.json").read_text())["digest"]["files"]) for backend in ("cpu", "tpu")}
    for version in ("v2", "v1"):
        assert (f"{version} (metadata version 1) torch-cpu cpu, sha256 digest of {digested['cpu']} files "
                f"torch-tpu tpu, sha256 digest of {digested['tpu']} files cpu, tpu {commit[:10]}") in versions
    assert f"first-release {commit[:10]} Upload rmsnorm-tpu v1 (torch-cpu, torch-tpu) v2, v1" in text
    assert "Other branches main" in text
    card = (published.builds["rmsnorm-tpu"] / "README.md").read_text()
    assert "license: apache-2.0 kernels tpu pallas" in text
    first_heading = re.search(r"^# (.+)$", card, re.M)[1]
    assert f"Card license: apache-2.0" in text and first_heading in text
    files = text[text.index("Files at v2"):text.index("History of v2")]
    build = published.builds["rmsnorm-tpu"]
    for path in sorted(p for p in build.rglob("*") if p.is_file()):
        assert f"{path.relative_to(build).as_posix()} " in files
        assert hashlib.sha256(path.read_bytes()).hexdigest() in files
    assert "History of v2" in text and "Upload rmsnorm-tpu v1 (torch-cpu, torch-tpu)" in text

    # Another revision: its own files and history; the snippet loads exactly what is shown.
    for revision, snippet in (("v1", 'version=1'), ("refs%2Fheads%2Fv1", 'version=1'),
                              ("first-release", 'revision="first-release"'), ("main", 'revision="main"')):
        text = visible_text(page(published, f"/kernels/{repo}/tree/{revision}"))
        assert f'kernel = get_kernel("{repo}", {snippet})' in text, revision


def test_untrusted_publishers_snippet_names_the_repo_in_trust_remote_code(published):
    text = visible_text(page(published, f"/kernels/{HOSTILE.repo}"))
    assert f'get_kernel("{HOSTILE.repo}", version=1, trust_remote_code=["{HOSTILE.repo}"])' in text


def test_user_content_renders_as_inert_text(published):
    html = page(published, f"/kernels/{HOSTILE.repo}")  # page() checks there is nothing active
    text = visible_text(html)
    assert "Card <script>alert('card')</script>" in text
    assert """<img src=x onerror="alert('img')">""" in text
    assert "<script>document.title = 'pwned'</script>" in text
    assert "[click me](javascript:alert('link'))" in text  # the link check left it as text
    assert "license: <script>alert('license')</script> <img src=x onerror=alert('tag')>" in text
    assert HOSTILE.title in text and HOSTILE.path in text and HOSTILE.backend in text
    assert " ".join(HOSTILE.message.split()) in text

    commit = HfApi(endpoint=published.url).kernel_info(HOSTILE.repo, revision="v1").sha
    commit_html = page(published, f"/kernels/{HOSTILE.repo}/commit/{commit}")
    commit_text = visible_text(commit_html)
    assert HOSTILE.title in commit_text and " ".join(HOSTILE.message.split()) in commit_text
    assert f"added {HOSTILE.path}" in commit_text
    assert "<title>&lt;b&gt;bold&lt;/b&gt;&lt;script&gt;" in commit_html


def test_card_links_and_images_point_at_the_repos_files_at_the_cards_commit(published):
    html = page(published, f"/kernels/{HOSTILE.repo}")
    commit = HfApi(endpoint=published.url).kernel_info(HOSTILE.repo, revision="v1").sha
    base = f"/kernels/{HOSTILE.repo}/resolve/{commit}/"
    assert f'<img src="{base}plot.png" alt="the plot" />' in html
    assert f'<a href="{base}build/torch-cpu/notes.md">the notes</a>' in html
    image = get(published.url + base + "plot.png")
    assert (image.status_code, image.headers["content-type"], image.content) == (200, "image/png", png())
    # A repo file opened in the browser runs nothing in this origin.
    assert "sandbox" in image.headers["content-security-policy"]
    assert image.headers["x-content-type-options"] == "nosniff"
    assert """<img src=x onerror="alert('img')">""" not in html  # as markup: it is there escaped


def test_commit_page_lists_what_the_commit_changed(published):
    api = HfApi(endpoint=published.url, token=TOKEN)
    repo = f"{TRUSTED}/attention-tpu"
    api.create_branch(repo, repo_type="kernel", branch="notes", revision="v1")
    api.upload_file(path_or_fileobj=b"first\n", path_in_repo="notes.txt", repo_id=repo, repo_type="kernel",
                    revision="notes")
    change = api.create_commit(repo, repo_type="kernel", revision="notes", commit_message="Rewrite the notes",
                               commit_description="why: a test", operations=[
                                   CommitOperationAdd("notes.txt", b"second\n"),
                                   CommitOperationDelete("build/torch-tpu/metadata.json")])
    text = visible_text(page(published, f"/kernels/{repo}/commit/{change.oid}"))
    assert "Rewrite the notes" in text and "why: a test" in text
    assert "modified notes.txt 7 B" in text and "deleted build/torch-tpu/metadata.json" in text
    assert text.count("added ") == 0
    text = visible_text(page(published, f"/kernels/{repo}/commit/{published.commits[repo]}"))
    assert "added build/torch-cpu/metadata.json" in text and "added build/torch-tpu/metadata.json" in text


def test_missing_things_are_404_pages(published):
    assert "Invalid rev id: v9" in visible_text(page(published, f"/kernels/{TRUSTED}/rmsnorm-tpu/tree/v9", status=404))
    assert "not found" in visible_text(page(published, "/kernels/nobody/nothing", status=404))
    for path in ("/favicon.ico", "/kernels/nothing", "/models/nobody"):
        assert "No page here" in visible_text(page(published, path, status=404)), path
    head = get(f"{published.url}/kernels/{TRUSTED}/rmsnorm-tpu", method="HEAD")
    assert (head.status_code, head.content) == (200, b"")
