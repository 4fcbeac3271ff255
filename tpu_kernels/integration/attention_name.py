"""attention_implementation(repo, version=N): the name kernelize gives transformers for an attention kernel, for
users who load models without kernelize (`from_pretrained(attn_implementation=...)`, transformers' `Serve`).

transformers loads an attention kernel by name through plain `kernels`, and again whenever another
implementation was loaded in between. The raw name (`tpu-kernels/attention-tpu:flash_attn_varlen_func`) goes to
kernels' cache or the Hub each time: kernels checks no digest, so it runs cache files rewritten after any check
(with a digest that matches them), and `UNSTABLE_KERNELS_ALL_LATEST` moves it to the newest version. The name
returned here is the one kernelize uses (`<repo>--<commit>--<kernel id>:flash_attn_varlen_func`,
`tpu_kernels.distribution.loader.kernels_names`): it resolves, in this process, to the module our loader has just
verified and imported. The process that calls this is the one that must load the model: child processes do not
inherit the name.
"""

from __future__ import annotations

from .attention import FLASH_FUNCTION


def attention_implementation(repo_id: str, *, version: int | None = None, revision: str | None = None,
                             backend: str | None = None, trust_remote_code: bool | list[str] = False) -> str:
    """The verified `attn_implementation` name of the attention kernel `repo_id` (loaded, checked against its
    digests and imported now, as `tpu_kernels.get_kernel` does, with the same arguments): pass it to
    `from_pretrained(attn_implementation=...)`, `model.set_attn_implementation(...)`, or transformers' `Serve`
    run in this process.

    ValueError if the kernel has no `flash_attn_varlen_func`; the loader's errors (a tampered kernel, an
    untrusted publisher, a missing version) as `get_kernel` raises them.
    """
    from ..distribution.loader import get_kernel, kernels_name

    kernel = get_kernel(repo_id, version=version, revision=revision, backend=backend,
                        trust_remote_code=trust_remote_code)
    if not hasattr(kernel, FLASH_FUNCTION):
        raise ValueError(f"{repo_id} has no {FLASH_FUNCTION}: it is not an attention kernel transformers can load "
                         "by name")
    return f"{kernels_name(kernel, repo_id)}:{FLASH_FUNCTION}"
