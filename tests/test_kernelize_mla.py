"""kernelize on latent-attention (MLA) models: every `expand_kv` architecture of transformers 5.25 that builds gets
our attention over its latent cache, with eager's tokens; decode never re-expands the cache."""

import pytest
import torch
from kernels import Mode

from tpu_kernels import kernelize
from tpu_kernels.distribution.builder import build_kernel_repo
from tpu_kernels.distribution.loader import get_local_kernel

from .conftest import REPO_ROOT
from .mla_models import MLA_ARCHITECTURES, MLA_ATTENTION_MODULES


@pytest.fixture(scope="module")
def attention_build(tmp_path_factory):
    return str(build_kernel_repo(REPO_ROOT / "kernel_repos" / "attention-tpu", tmp_path_factory.mktemp("build")))


def _attention_only(build):
    return {"experts": None, "rmsnorm": None, "attention": build}


def _prompt(batch=2, length=6):
    """Left-padded: the second row's first two positions are padding."""
    ids = torch.randint(1, 128, (batch, length), generator=torch.Generator().manual_seed(11))
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, :2] = 0
    return ids, mask


class KvExpansions:
    """Counts the calls of every MLA module's kv_b_proj: each is a re-expansion of the latent."""

    def __init__(self, model):
        self.calls = 0
        self.handles = [m.kv_b_proj.register_forward_hook(self._count) for m in model.modules()
                        if hasattr(type(m), "expand_kv")]

    def _count(self, *_):
        self.calls += 1


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MLA_ARCHITECTURES))
def test_mla_attention_replaced_and_tokens_match_eager(name, attention_build):
    model, _ = MLA_ARCHITECTURES[name]()
    ids, mask = _prompt()
    with torch.no_grad():
        eager_logits = model(ids, attention_mask=mask).logits
        eager_tokens = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    kernelize(model, repos=_attention_only(attention_build))
    (entry,) = model.tpu_kernels_report.replaced("attention")
    assert "latent attention (MLA)" in entry.note
    latent = [n for n, m in model.named_modules() if hasattr(type(m), "expand_kv")]
    assert set(latent) <= set(entry.modules)
    expansions = KvExpansions(model)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
        tokens = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    valid = mask.bool()
    assert (logits - eager_logits)[valid].abs().max().item() <= 1e-4
    assert torch.equal(tokens, eager_tokens)
    # The prompt's forward and generate's prefill expand (a long prefill's form, here priced cheaper for 6 tokens
    # or not); the 3 decode steps after the prefill never do.
    assert expansions.calls <= 2 * len(latent)


def _decode_step_expansions(model, ids, mask) -> int:
    """kv_b_proj calls in one decode step after a prefill of `ids` (the cache: transformers' DynamicCache)."""
    with torch.no_grad():
        prefill = model(ids, attention_mask=mask, use_cache=True)
        expansions = KvExpansions(model)
        next_token = prefill.logits[:, -1:].argmax(-1)
        model(next_token, attention_mask=torch.cat([mask, mask[:, -1:]], 1), past_key_values=prefill.past_key_values)
    return expansions.calls


def test_a_decode_step_reads_the_latent_cache_without_expanding_it(attention_build):
    model, _ = MLA_ARCHITECTURES["deepseek_v3"]()
    ids, mask = _prompt()
    layers = len(MLA_ATTENTION_MODULES["deepseek_v3"])
    assert _decode_step_expansions(model, ids, mask) == layers  # transformers' own: every layer, every step
    kernelize(model, repos=_attention_only(attention_build))
    assert _decode_step_expansions(model, ids, mask) == 0


@pytest.mark.slow
def test_static_cache_generate_matches_eager(attention_build):
    model, _ = MLA_ARCHITECTURES["deepseek_v3"]()
    ids, mask = _prompt()
    options = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        eager = model.generate(ids, **options)
        kernelize(model, repos=_attention_only(attention_build))
        assert torch.equal(model.generate(ids, **options), eager)


@pytest.mark.slow
def test_training_takes_the_expanded_form_with_eagers_gradients(attention_build):
    model, _ = MLA_ARCHITECTURES["deepseek_v3"]()
    ids, mask = _prompt()
    model.train()

    def gradients():
        model.zero_grad()
        loss = model(ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    eager_loss, eager_grads = gradients()
    kernelize(model, mode=Mode.TRAINING, repos=_attention_only(attention_build))
    (entry,) = model.tpu_kernels_report.replaced("attention")
    expansions = KvExpansions(model)
    loss, grads = gradients()
    assert expansions.calls == len(MLA_ATTENTION_MODULES["deepseek_v3"])  # the expanded form, once per layer
    assert abs(loss - eager_loss) <= 1e-5
    assert set(grads) == set(eager_grads)
    for name, grad in grads.items():
        assert (grad - eager_grads[name]).abs().max() <= 1e-4 * max(1.0, eager_grads[name].abs().max()), name


def test_a_module_whose_kv_b_proj_cannot_be_folded_is_expanded_at_every_call(attention_build):
    model, _ = MLA_ARCHITECTURES["deepseek_v3"]()
    first = model.model.layers[0].self_attn
    projection = first.kv_b_proj
    first.kv_b_proj = torch.nn.Linear(projection.in_features, projection.out_features, bias=True)
    ids, mask = _prompt()
    with torch.no_grad():
        eager = model(ids, attention_mask=mask).logits
    kernelize(model, repos=_attention_only(attention_build))
    (entry,) = model.tpu_kernels_report.replaced("attention")
    assert "1 module(s) expanded at every call (kv_b_proj has a bias)" in entry.note
    assert _decode_step_expansions(model, ids, mask) == 1
    with torch.no_grad():
        assert (model(ids, attention_mask=mask).logits - eager)[mask.bool()].abs().max() <= 1e-4


def test_one_real_layer_width_decode_matches_eager(attention_build):
    """DeepSeek-V3's attention at its own width (128 heads, latent 512 + rope 64, nope 128, v 128), small hidden size
    and cache: one absorbed decode step against transformers' expanded eager attention."""
    from transformers import DeepseekV3Config, DynamicCache
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    config = DeepseekV3Config(hidden_size=256, num_attention_heads=128, num_key_value_heads=128, kv_lora_rank=512,
                              q_lora_rank=64, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                              num_hidden_layers=1, attn_implementation="eager")
    torch.manual_seed(0)
    module = DeepseekV3Attention(config, layer_idx=0).eval()
    rotary = DeepseekV3RotaryEmbedding(config)
    hidden = torch.randn(1, 17, 256)
    positions = torch.arange(17)[None]

    def decode_output():
        cache = DynamicCache(config=config)
        causal = torch.ones(16, 16, dtype=torch.bool).tril()[None, None]
        with torch.no_grad():
            module(hidden[:, :16], rotary(hidden[:, :16], positions[:, :16]), causal, cache=cache)
            out, _ = module(hidden[:, 16:], rotary(hidden[:, 16:], positions[:, 16:]), None, cache=cache)
        return out

    eager = decode_output()
    kernel = get_local_kernel(attention_build, backend="cpu")
    kernel.serve_latent(module)
    from transformers import AttentionInterface
    AttentionInterface.register("tpu_kernels_test_latent", kernel.latent_attention_forward)
    config._attn_implementation = "tpu_kernels_test_latent"
    ours = decode_output()
    assert (ours - eager).abs().max() <= 1e-4 * eager.abs().max()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe_lite", "mistral4"])
def test_bf16_logits_within_bf16_tolerance_of_eager(name, attention_build):
    model, _ = MLA_ARCHITECTURES[name]()
    model = model.to(torch.bfloat16)
    ids, mask = _prompt()
    with torch.no_grad():
        eager = model(ids, attention_mask=mask).logits.float()
        kernelize(model, repos=_attention_only(attention_build))
        ours = model(ids, attention_mask=mask).logits.float()
    valid = mask.bool()
    assert (ours - eager)[valid].abs().max() <= 2e-2 * eager[valid].abs().max()
