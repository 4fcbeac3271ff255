"""Hardening V (issue 73, AT1): `tpu_kernels.attention_implementation` gives users without kernelize the
verified attention name kernelize uses; the raw name (`org/repo:flash_attn_varlen_func`) loads from kernels'
cache, which kernels does not check."""

from __future__ import annotations

import pytest
import transformers
from huggingface_hub import HfApi

import tpu_kernels
from tpu_kernels.distribution.loader import get_kernel

from .loader_support import cached_variant, publish
from .test_loader_hardening_iv import _FLASH_KERNEL, FLASHY, _flash_build, _flash_varlen, _write_variant

pytestmark = pytest.mark.usefixtures("local_agent_registry")


def _tiny_llama(attn_implementation: str):
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)


@pytest.mark.slow
def test_the_verified_name_loads_the_verified_module_whatever_the_cache_holds_since(hub, client, tmp_path):
    publish(hub, _flash_build(tmp_path, answer=1), repo_id=FLASHY, version=1)
    name = tpu_kernels.attention_implementation(FLASHY, version=1)
    commit = HfApi().repo_info(FLASHY, repo_type="kernel", revision="v1").sha
    assert name.startswith(f"{FLASHY}--{commit}--") and name.endswith(":flash_attn_varlen_func")
    verified = get_kernel(FLASHY, version=1)
    variant = cached_variant(client, commit, repo_id=FLASHY)
    marker = tmp_path / "rewritten code ran"
    tampered = tmp_path / "tampered"
    tampered.mkdir()
    for file in ("_value.py", "metadata.json"):
        (tampered / file).write_bytes((variant / file).read_bytes())
    _write_variant(tampered, f"open({str(marker)!r}, 'w').close()\n" + _FLASH_KERNEL, "_flashy_cpu_attacker")
    for file in ("__init__.py", "metadata.json"):  # the cache rewritten after the check, its digest matching
        (variant / file).resolve().write_bytes((tampered / file).read_bytes())

    model = _tiny_llama(name)
    assert model.config._attn_implementation == name
    assert _flash_varlen(name) is verified.flash_attn_varlen_func
    assert not marker.exists()


def test_a_kernel_without_flash_functions_has_no_attention_name(hub, client, tmp_path):
    from .loader_support import REPO, make_build

    publish(hub, make_build(tmp_path, answer=3), repo_id=REPO, version=1)
    with pytest.raises(ValueError, match="has no flash_attn_varlen_func"):
        tpu_kernels.attention_implementation(REPO, version=1)
