"""transformers' own ways to take a Hub kernel, with ours: `use_kernels=True` with a `KernelConfig` naming our
repo, through unmodified transformers 5.25 and kernels 0.19 against a local Hub."""

from __future__ import annotations

import pytest
import torch

from .loader_support import publish
from .test_kernelize import _prompt, _tiny_model

pytestmark = [pytest.mark.usefixtures("local_agent_registry"), pytest.mark.slow]

RMSNORM_REPO = "tpu-kernels/rmsnorm-tpu"


def test_the_kernel_config_mapping_for_tpu_takes_our_rmsnorm_from_the_hub(hub, client, kernel_builds):
    """What `use_kernels=True` with this KernelConfig does on a TPU VM: transformers builds this mapping for device
    "tpu" and hands it to kernels' kernelize (`transformers.integrations.hub_kernels.kernelize`). Here the model's
    tensors are on the CPU, so kernels loads our torch-cpu variant: the TPU one needs a TPU."""
    import kernels
    from transformers import KernelConfig

    publish(hub, kernel_builds["rmsnorm-tpu"], repo_id=RMSNORM_REPO)
    model = _tiny_model("qwen3_moe")
    prompt = _prompt()
    with torch.no_grad():
        eager = model(prompt).logits
    config = KernelConfig()
    config.update_kernel(RMSNORM_REPO, "RMSNorm", "RMSNorm", "tpu", kernels.Mode.INFERENCE, trust_remote_code=True)
    with kernels.use_kernel_mapping(config.kernel_mapping, inherit_mapping=False):
        kernels.kernelize(model, device="tpu", mode=kernels.Mode.INFERENCE, use_fallback=kernels.KernelizeFallback.ALL)

    layers = kernels.get_kernelized_layers(model).layers
    norms = [name for name, module in model.named_modules() if type(module).__name__.endswith("RMSNorm")]
    assert norms and sorted(layers) == sorted(norms)
    ours = kernels.LayerRepository(RMSNORM_REPO, layer_name="RMSNorm", version=1, trust_remote_code=True)
    assert all(layer.repo == ours for layer in layers.values())
    with torch.no_grad():
        kernelized = model(prompt).logits
    torch.testing.assert_close(kernelized, eager, atol=2e-5, rtol=2e-5)


def test_transformers_refuses_use_kernels_on_a_cpu_model():
    """Why the README says `use_kernels=True` needs the model on a TPU: transformers takes Hub kernels only for
    accelerator devices. If this starts passing, the README's note is out of date."""
    from transformers import KernelConfig

    model = _tiny_model("qwen3_moe")
    config = KernelConfig({"RMSNorm": (f"{RMSNORM_REPO}:RMSNorm", {"version": 1, "trust_remote_code": True})})
    with pytest.raises(ValueError, match="Only devices in .* are supported, got: cpu"):
        model.set_use_kernels(True, config)
