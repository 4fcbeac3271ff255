"""Hardening V (issue 73): the local Hub's model alias tells an anonymous client nothing about hidden repos
(HA2, HA3). The alias: a read of a model repo that does not exist answers from the kernel repo of that id."""

from __future__ import annotations

import json
import os

import pytest
from huggingface_hub import HfApi

from .hub_support import FAST, TOKEN, add, http, module_hub

pytestmark = pytest.mark.usefixtures("local_agent_registry")

hub = module_hub(TOKEN, FAST)


def answer(hub, path: str, token: str | None = None) -> tuple[int, str, str | None]:
    """(status, error message with the repo id replaced by ID, the commit the answer came from)."""
    status, headers, body = http("GET", hub.url + path, token=token)
    message = headers.get("X-Error-Message", "")
    data = json.loads(body) if status == 200 else None
    commit = data.get("sha") if isinstance(data, dict) else None
    return status, message, commit


def kernel_repo(api: HfApi, repo_id: str, *, private: bool) -> str:
    api.create_repo(repo_id, repo_type="kernel", private=private)
    return api.create_commit(repo_id, repo_type="kernel", commit_message="kernel",
                             operations=[add("benchmarks/benchmark.py", os.urandom(16))]).oid


@pytest.mark.parametrize("read", ["/api/models/{id}", "/api/models/{id}/revision/main",
                                  "/api/models/{id}/tree/main"])
def test_a_hidden_kernel_read_through_the_model_alias_answers_as_a_missing_model(hub, read):
    api = HfApi(endpoint=hub.url, token=TOKEN)
    hidden, missing = f"ha2-{os.urandom(3).hex()}/pk", f"ha2-{os.urandom(3).hex()}/none"
    kernel_repo(api, hidden, private=True)
    hidden_answer = answer(hub, read.format(id=hidden))
    missing_answer = answer(hub, read.format(id=missing))
    assert hidden_answer[0] == missing_answer[0] == 404
    assert hidden_answer[1].replace(hidden, "ID") == missing_answer[1].replace(missing, "ID"), (hidden_answer,
                                                                                               missing_answer)
    assert "kernel" not in hidden_answer[1]
    assert answer(hub, read.format(id=hidden), token=TOKEN)[0] == 200  # the token's holder reads it


def test_a_private_model_beside_a_public_kernel_answers_as_if_no_model_existed(hub):
    api = HfApi(endpoint=hub.url, token=TOKEN)
    namespace = f"ha3-{os.urandom(3).hex()}"
    alone, beside = f"{namespace}/alone", f"{namespace}/beside"
    kernel_repo(api, alone, private=False)
    kernel_commit = kernel_repo(api, beside, private=False)
    api.create_repo(beside, private=True)  # a model repo of the same id, hidden
    model_commit = api.create_commit(beside, commit_message="weights", operations=[add("w.bin", b"w")]).oid
    assert answer(hub, f"/api/models/{alone}")[0] == 200
    assert answer(hub, f"/api/models/{beside}") == (200, "", kernel_commit)
    assert answer(hub, f"/api/models/{beside}", token=TOKEN) == (200, "", model_commit)
