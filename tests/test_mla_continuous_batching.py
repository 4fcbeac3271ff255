"""kernelize's latent attention under transformers' continuous batching (`generate_batch`): the eight MLA
architectures whose latent cache transformers pages run it on the kernel, with transformers' own tokens; the
others keep a name without "flash", and the report says why."""

import pytest
import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

from tpu_kernels import kernelize
from tpu_kernels.distribution.builder import build_kernel_repo
from tpu_kernels.distribution.loader import get_local_kernel

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


class PackedCalls:
    """Counts the attention calls that continuous batching packs, per form (the kernel's `mla` module's)."""

    def __init__(self, monkeypatch, mla):
        self.forms = {"absorbed": 0, "expanded": 0}
        for form in self.forms:
            function = getattr(mla, f"_{form}_packed")
            monkeypatch.setattr(mla, f"_{form}_packed", self._counted(form, function))

    def _counted(self, form, function):
        def counted(*args, **kwargs):
            self.forms[form] += 1
            return function(*args, **kwargs)
        return counted


@pytest.mark.slow
@pytest.mark.parametrize("name", CONTINUOUS_BATCHING)
def test_generate_batch_runs_on_the_latent_kernel_with_transformers_tokens(name, attention_build, monkeypatch):
    model, _ = MLA_ARCHITECTURES[name]()
    expected = _generate_batch(model)  # transformers' own (sdpa), float32
    assert _generate(model) == expected
    kernelize(model, repos=_attention_only(attention_build))
    (entry,) = model.tpu_kernels_report.replaced("attention")
    assert "generate and generate_batch" in entry.note
    assert "flash" in model.config._attn_implementation
    packed = PackedCalls(monkeypatch, get_local_kernel(attention_build).mla)
    assert _generate_batch(model) == expected
    # Every step runs every MLA layer packed; decode steps (one query per sequence) price the absorbed form lower.
    assert packed.forms["absorbed"] >= NEW_TOKENS - 1


def _packed_call():
    """One MLA module of a tiny DeepSeek-V3 and a packed call as continuous batching makes it: a chunk of 3 queries
    over 7 keys, a decode step over 5, a prefill of 5, and a padding row past the last sequence."""
    model, _ = MLA_ARCHITECTURES["deepseek_v3"]()
    module = model.model.layers[0].self_attn
    cu_seq_lens_q, cu_seq_lens_k = torch.tensor([0, 3, 4, 9], dtype=torch.int32), torch.tensor([0, 7, 12, 17],
                                                                                               dtype=torch.int32)
    generator = torch.Generator().manual_seed(3)
    heads, nope, rope = module.num_heads, module.qk_nope_head_dim, module.qk_rope_head_dim
    query = torch.randn(1, heads, 10, nope + rope, generator=generator)
    kv_nope = torch.randn(1, 1, 17, module.kv_lora_rank, generator=generator)
    k_rot = torch.randn(1, 1, 17, rope, generator=generator)
    kwargs = dict(cu_seq_lens_q=cu_seq_lens_q, cu_seq_lens_k=cu_seq_lens_k, max_length_q=5, max_length_k=7,
                  is_causal=True)
    return module, query, kv_nope, k_rot, kwargs


def _reference(module, query, kv_nope, k_rot, kwargs) -> torch.Tensor:
    """[1, total_q, H, v] in float64: each sequence's queries against its keys, the queries last (bottom-right)."""
    key, value = (t.double() for t in type(module).expand_kv(module, kv_nope, k_rot))
    out = torch.zeros(query.shape[2], query.shape[1], value.shape[-1], dtype=torch.float64)
    cu_q, cu_k = kwargs["cu_seq_lens_q"].tolist(), kwargs["cu_seq_lens_k"].tolist()
    for q_start, q_end, k_start, k_end in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]):
        logits = query[0, :, q_start:q_end].double() @ key[0, :, k_start:k_end].transpose(-1, -2) * module.scaling
        positions = torch.arange(k_end - k_start)
        visible = positions[None, :] <= positions[-(q_end - q_start):, None]
        weights = logits.masked_fill(~visible, float("-inf")).softmax(-1)
        out[q_start:q_end] = (weights @ value[0, :, k_start:k_end]).transpose(0, 1)
    return out[None]


@pytest.mark.parametrize("absorbed", [True, False], ids=["absorbed", "expanded"])
def test_a_packed_call_matches_each_sequence_apart_in_either_form(absorbed, attention_build, monkeypatch):
    kernel = get_local_kernel(attention_build)
    monkeypatch.setattr(kernel.mla, "absorbed_is_cheaper", lambda shape, target: absorbed)
    module, query, kv_nope, k_rot, kwargs = _packed_call()
    expected = _reference(module, query, kv_nope, k_rot, kwargs)
    kernel.serve_latent(module)
    packed = PackedCalls(monkeypatch, kernel.mla)
    with torch.no_grad():
        out, _ = kernel.latent_attention_forward(module, query, kv_nope, k_rot, None, scaling=module.scaling,
                                                 **kwargs)
    assert packed.forms == {"absorbed": int(absorbed), "expanded": int(not absorbed)}
    assert out.shape == expected.shape
    assert (out.double() - expected).abs().max().item() <= 1e-5
    assert not out[0, 9].any()  # the padding row past the last sequence


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
