"""CUDA-only checks (skipped without a GPU): kernels, compile with checkpointing, a full-size step."""

import pytest
import torch

import SD_Model

pytestmark = pytest.mark.gpu


def _inputs(batch, size, width, device):
    g = torch.Generator(device=device).manual_seed(0)
    latents = torch.randn(batch, 4, size, size, generator=g, device=device)
    context = torch.randn(batch, 77, width, generator=g, device=device)
    timesteps = torch.randint(0, 1000, (batch,), generator=g, device=device)
    return latents, timesteps, context


def test_sd1_step_runs_on_the_fast_attention_kernels_with_checkpointing():
    device = torch.device("cuda")
    unet = SD_Model.build_unet("sd1", seed=0, grad_checkpointing=True, channels_last=True).to(device)
    latents, timesteps, context = _inputs(2, 64, 768, device)
    with SD_Model.attention_context(device), torch.autocast("cuda", dtype=torch.bfloat16):
        out = unet(latents, timesteps, encoder_hidden_states=context).sample
    assert torch.count_nonzero(out) == 0  # zero-initialised output
    out.float().sub(latents).square().mean().backward()
    assert torch.isfinite(unet.conv_out.weight.grad).all() and unet.conv_out.weight.grad.abs().sum() > 0


def test_compile_with_checkpointing_matches_eager():
    device = torch.device("cuda")
    eager = SD_Model.build_unet("tiny", seed=0, from_scratch=False, grad_checkpointing=True).to(device)
    compiled_base = SD_Model.build_unet("tiny", seed=0, from_scratch=False, grad_checkpointing=True).to(device)
    compiled = torch.compile(compiled_base)
    latents, timesteps, context = _inputs(4, 8, 64, device)
    grads = []
    for model, params in ((eager, eager), (compiled, compiled_base)):
        with SD_Model.attention_context(device):
            model(latents, timesteps, encoder_hidden_states=context).sample.square().mean().backward()
        grads.append(params.conv_in.weight.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-3, atol=1e-4)
