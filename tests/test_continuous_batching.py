"""Our attention through transformers' own flash path, from a (local) Hub: `generate` and continuous batching.

`attn_implementation="<org>/attention-tpu"` makes transformers load the kernel
with `kernels.get_kernel` and wrap its `flash_attn_func`/`flash_attn_varlen_func`
in its flash-attention forward. Continuous batching (`generate_batch`) takes
only implementation names that hold "flash", so it runs on
`"<org>/attention-tpu:flash_attn_varlen_func"` (the same kernel, naming the
function transformers calls). Off CUDA and XPU, transformers' continuous
batching gathers each layer's keys and values from its paged cache and calls
`flash_attn_varlen_func` with the sequences' cumulative lengths: prefills,
chunks of long prompts against their cache, and decodes in one call.

Each case compares greedy tokens with eager attention, per request.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
import transformers
from huggingface_hub import HfApi
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

from tpu_kernels import kernelize
from tpu_kernels.distribution.builder import build_kernel_repo

from .conftest import REPO_ROOT
from .loader_support import TRUSTED, publish

ATTENTION_REPO = f"{TRUSTED}/attention-tpu"
CB_NAME = f"{ATTENTION_REPO}:flash_attn_varlen_func"

SMALL = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=64, max_position_embeddings=512)
CONFIGS = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**SMALL, moe_intermediate_size=48, num_experts=8,
                                                     num_experts_per_tok=2, intermediate_size=96,
                                                     decoder_sparse_step=1),
    # Sinks in every layer, a sliding window in the first.
    "gpt_oss": lambda: transformers.GptOssConfig(**SMALL, intermediate_size=48, num_local_experts=8,
                                                 num_experts_per_tok=2,
                                                 layer_types=["sliding_attention", "full_attention"],
                                                 sliding_window=8),
    "mixtral": lambda: transformers.MixtralConfig(**SMALL, intermediate_size=48, num_local_experts=8,
                                                  num_experts_per_tok=2),
    "gemma4": lambda: transformers.Gemma4TextConfig(
        **SMALL, intermediate_size=96, enable_moe_block=True, num_experts=8, top_k_experts=2,
        moe_intermediate_size=32, global_head_dim=64, layer_types=["sliding_attention", "full_attention"],
        sliding_window=8),
}


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    out = tmp_path_factory.mktemp("builds")
    return {name: build_kernel_repo(REPO_ROOT / "kernel_repos" / name, out)
            for name in ("attention-tpu", "ragged-dot-tpu", "rmsnorm-tpu")}


@pytest.fixture
def attention_on_hub(hub, client, builds) -> str:
    """The attention kernel published as v1 of <trusted org>/attention-tpu on a Hub clients point at."""
    publish(hub, builds["attention-tpu"], repo_id=ATTENTION_REPO)
    return ATTENTION_REPO


def tiny_model(name: str):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 3:  # expert weights start empty in some models: make them random, never zero
                parameter.normal_(std=0.1)
    # Random weights may pick any token: no end-of-sequence token, so every request runs its full length.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def prompts(lengths: list[int]) -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(1, 128, (n,), generator=generator).tolist() for n in lengths]


def eager_tokens(model, requests: list[list[int]], new_tokens: int) -> list[list[int]]:
    with torch.no_grad():
        return [model.generate(torch.tensor([r]), max_new_tokens=new_tokens, do_sample=False)[0, len(r):].tolist()
                for r in requests]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_generate_through_the_hub_flash_path_matches_eager(name, attention_on_hub):
    model = tiny_model(name)
    requests = prompts([7, 12])
    expected = eager_tokens(model, requests, 5)
    model.set_attn_implementation(attention_on_hub)
    assert transformers.AttentionInterface._global_mapping[attention_on_hub].__name__ == "flash_attention_forward"
    # One request at a time (flash_attn_func) and both together, left-padded (flash_attn_varlen_func).
    assert eager_tokens(model, requests, 5) == expected
    batch = torch.tensor([[0] * 5 + requests[0], requests[1]])
    mask = torch.tensor([[0] * 5 + [1] * 7, [1] * 12])
    with torch.no_grad():
        both = model.generate(batch, attention_mask=mask, max_new_tokens=5, do_sample=False)[:, 12:].tolist()
    assert both == expected


def generate_batch(model, requests, new_tokens, **cb_options):
    config = ContinuousBatchingConfig(**cb_options)
    outputs = model.generate_batch(requests, GenerationConfig(max_new_tokens=new_tokens, do_sample=False,
                                                              eos_token_id=None, pad_token_id=0),
                                   continuous_batching_config=config, warmup=False)
    assert len(outputs) == len(requests) and not [o.error for o in outputs.values() if o.error]
    return [o.generated_tokens for o in outputs.values()]


# More requests than one batch holds (at most 32 tokens and 3 requests a step), prompts from one token to a few
# hundred (chunked prefill against the cache), pages of 16 tokens.
CB_OPTIONS = dict(max_batch_tokens=32, max_requests_per_batch=3, page_size=16, num_blocks=96)
LENGTHS = [1, 5, 300, 17, 2, 64]


class VarlenSteps:
    """Watches what transformers' flash path is handed under one implementation name (each call's query and key
    lengths per sequence), and checks that the varlen function it calls is the kernel's."""

    def __init__(self, kernel):
        self.kernel, self.lengths = kernel, []

    @contextmanager
    def watching(self, name: str):
        from transformers.modeling_flash_attention_utils import lazy_import_flash_attention

        assert lazy_import_flash_attention(name)[0][1] is self.kernel.flash_attn_varlen_func
        flash_forward = transformers.AttentionInterface._global_mapping[name]

        def recorded(module, query, key, value, attention_mask, **kwargs):
            if kwargs.get("cu_seq_lens_q") is not None:
                self.lengths.append(list(zip(kwargs["cu_seq_lens_q"].diff().tolist(),
                                             kwargs["cu_seq_lens_k"].diff().tolist())))
            return flash_forward(module, query, key, value, attention_mask, **kwargs)

        transformers.AttentionInterface.register(name, recorded)
        try:
            yield self
        finally:
            transformers.AttentionInterface.register(name, flash_forward)

    def saw_every_kind_of_step(self) -> bool:
        """Several sequences in one call, prefills, chunks of a prompt against its cache, and decodes."""
        pairs = [pair for call in self.lengths for pair in call]
        return (any(len(call) > 1 for call in self.lengths) and any(1 < q == k for q, k in pairs)
                and any(1 < q < k for q, k in pairs) and any(q == 1 < k for q, k in pairs))


@pytest.fixture
def varlen_steps(attention_on_hub):
    import kernels

    return VarlenSteps(kernels.get_kernel(attention_on_hub, version=1))


def accept_our_flash_name(model) -> None:
    """GPT-OSS lists the flash kernels it accepts, and transformers replaces any other name holding "flash" with the
    first of them (kernels-community/vllm-flash-attn3): ours joins the list. transformers 5.25 has no public way to
    do this; the attribute is the model's own copy of its class's list."""
    model._compatible_flash_implementations = [*type(model)._compatible_flash_implementations, CB_NAME]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_continuous_batching_on_our_attention_matches_eager(name, attention_on_hub, builds, varlen_steps):
    model = tiny_model(name)
    requests = prompts(LENGTHS)
    expected = eager_tokens(model, requests, 4)
    kernelize(model, repos={"experts": str(builds["ragged-dot-tpu"]), "rmsnorm": str(builds["rmsnorm-tpu"]),
                            "attention": None})
    assert {e.kind for e in model.tpu_kernels_report.entries if e.replaced} == {"experts", "rmsnorm"}
    if getattr(model, "_compatible_flash_implementations", None) is not None:
        accept_our_flash_name(model)
    model.set_attn_implementation(CB_NAME)
    with varlen_steps.watching(CB_NAME):
        assert generate_batch(model, requests, 4, **CB_OPTIONS) == expected
    assert varlen_steps.saw_every_kind_of_step(), varlen_steps.lengths


@pytest.mark.slow
def test_kernelize_from_a_hub_serves_generate_and_continuous_batching(attention_on_hub, builds, varlen_steps):
    """One kernelize call (experts, RMSNorm and attention) and both generate and generate_batch run on the kernels."""
    model = tiny_model("qwen3_moe")
    requests = prompts([3, 40, 1, 9])
    expected = eager_tokens(model, requests, 4)
    kernelize(model, repos={"experts": str(builds["ragged-dot-tpu"]), "rmsnorm": str(builds["rmsnorm-tpu"]),
                            "attention": f"{attention_on_hub}@1"})
    report = model.tpu_kernels_report
    assert {e.kind for e in report.entries if e.replaced} == {"experts", "rmsnorm", "attention"}, repr(report)
    # Named after the commit kernelize verified; the name resolves to the module verified, never to the v1 branch.
    verified = HfApi().repo_info(attention_on_hub, repo_type="kernel", revision="v1").sha
    assert model.config._attn_implementation.startswith(f"{attention_on_hub}--{verified}--attention_tpu_cpu_")
    assert model.config._attn_implementation.endswith(":flash_attn_varlen_func")
    assert "generate and generate_batch" in repr(report)
    assert eager_tokens(model, requests, 4) == expected
    with varlen_steps.watching(model.config._attn_implementation):
        assert generate_batch(model, requests, 4, max_batch_tokens=16, max_requests_per_batch=2, page_size=16,
                              num_blocks=32) == expected
    assert varlen_steps.saw_every_kind_of_step(), varlen_steps.lengths


@pytest.mark.slow
def test_kernelize_says_when_generate_batch_is_unavailable(attention_on_hub, builds):
    """GPT-OSS replaces foreign flash kernels: kernelize serves its attention through attention_forward, says
    generate_batch is unavailable, and transformers refuses it."""
    model = tiny_model("gpt_oss")
    kernelize(model, repos={"experts": None, "rmsnorm": None, "attention": f"{attention_on_hub}@1"})
    (entry,) = model.tpu_kernels_report.replaced("attention")
    assert "generate_batch unavailable" in entry.note and "kernels-community/vllm-flash-attn3" in entry.note
    assert "flash" not in model.config._attn_implementation
    with pytest.raises(ValueError, match="not supported for continuous batching"):
        model.init_continuous_batching()
