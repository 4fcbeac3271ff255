"""kernelize's latent attention under transformers' continuous batching (`generate_batch`): the eight MLA
architectures whose latent cache transformers pages run it on the kernel, with transformers' own tokens; the
others keep a name without "flash", and the report says why. The packed calls in either form:
kernel_repos/attention-tpu/tests/test_mla_packed.py."""

import pytest
import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

from tpu_kernels import kernelize
from tpu_kernels.distribution.builder import build_kernel_repo

from .conftest import REPO_ROOT
from .mla_models import MLA_ARCHITECTURES, MLA_NO_CONTINUOUS_BATCHING

CONTINUOUS_BATCHING = sorted(set(MLA_ARCHITECTURES) - set(MLA_NO_CONTINUOUS_BATCHING))
# Three lengths; at most 16 tokens a step, so the last prompt's prefill ends in a second step, a chunk against its
# own cache beside the other two's first decode.
PROMPTS = [[1, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23], [1, 3], [1, 20, 21, 22, 23]]
CB_OPTIONS = dict(max_batch_tokens=16, max_requests_per_batch=3, page_size=16, num_blocks=16)
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def attention_build(tmp_path_factory):
    return str(build_kernel_repo(REPO_ROOT / "kernel_repos" / "attention-tpu", tmp_path_factory.mktemp("build")))


def _attention_only(build):
    return {"experts": None, "rmsnorm": None, "attention": build}


def _generate_batch(model) -> list[list[int]]:
    settings = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    outputs = model.generate_batch(PROMPTS, settings, continuous_batching_config=ContinuousBatchingConfig(
        **CB_OPTIONS), warmup=False, progress_bar=False)
    assert not [o.error for o in outputs.values() if o.error]
    return [outputs[f"req_{index}"].generated_tokens for index in range(len(PROMPTS))]


def _generate(model) -> list[list[int]]:
    """`generate` of the prompts in one batch, left-padded, with their mask."""
    longest = max(len(prompt) for prompt in PROMPTS)
    ids = torch.tensor([[0] * (longest - len(prompt)) + prompt for prompt in PROMPTS])
    mask = torch.tensor([[0] * (longest - len(prompt)) + [1] * len(prompt) for prompt in PROMPTS])
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=0)[:, longest:].tolist()


class KvExpansions:
    """Counts the calls of every MLA module's kv_b_proj: each is an expansion of the latent."""

    def __init__(self, model):
        self.calls = 0
        for module in model.modules():
            if hasattr(type(module), "expand_kv"):
                module.kv_b_proj.register_forward_hook(self._count)

    def _count(self, *_):
        self.calls += 1


@pytest.mark.slow
@pytest.mark.parametrize("name", CONTINUOUS_BATCHING)
def test_generate_batch_runs_on_the_latent_kernel_with_transformers_tokens(name, attention_build):
    model, _ = MLA_ARCHITECTURES[name]()
    expected = _generate_batch(model)  # transformers' own (sdpa), float32
    assert _generate(model) == expected
    kernelize(model, repos=_attention_only(attention_build))
    (entry,) = model.tpu_kernels_report.replaced("attention")
    assert "generate and generate_batch" in entry.note
    assert "flash" in model.config._attn_implementation
    expansions = KvExpansions(model)
    assert _generate_batch(model) == expected
    # transformers expands every layer's latent at every step; at these widths (latent 16, 4 heads) the kernel
    # prices the absorbed form lower for every step, prefills included, so nothing is expanded.
    assert expansions.calls == 0


def test_models_continuous_batching_cannot_page_keep_a_name_without_flash(attention_build):
    """transformers' continuous batching has no cache for DSA indexers (nor for linear attention): the model keeps
    latent attention for `generate` under a name without "flash", which generate_batch refuses."""
    model, _ = MLA_ARCHITECTURES["deepseek_v32"]()
    kernelize(model, repos=_attention_only(attention_build))
    (entry,) = model.tpu_kernels_report.replaced("attention")
    assert entry.note.endswith("generate_batch unavailable (transformers' continuous batching has no cache for this "
                               "model's layers (Invalid layer type: indexed_attention))")
    assert "flash" not in model.config._attn_implementation
    settings = GenerationConfig(max_new_tokens=1, do_sample=False, eos_token_id=None, pad_token_id=0)
    with pytest.raises(ValueError, match="is not supported for continuous batching"):
        model.generate_batch([[5, 17, 33]], settings, warmup=False)


@pytest.mark.slow
def test_the_fixed_shape_recipe_keeps_latent_attention_for_generate(attention_build):
    """With the fixed-shape recipe `generate` keeps the latent attention (the name holds "flash", but it is not
    transformers' flash path, which the recipe swaps for attention_forward) and gives eager's tokens."""
    model, _ = MLA_ARCHITECTURES["deepseek_v2"]()
    expected = _generate(model)
    kernelize(model, repos=_attention_only(attention_build), fixed_shapes=True)
    name = model.config._attn_implementation
    assert _generate(model) == expected
    assert model.config._attn_implementation == name
