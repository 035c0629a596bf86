"""The CUDA-only code paths, run on fake CUDA tensors: a device mismatch fails here, not on a GPU.

Covered: a training step (bf16 autocast on CUDA, fused AdamW on CUDA tensors, clipping, the EMA on
the GPU and on the CPU with its pinned staging copies, CUDA generators for noise, timesteps and CFG
dropout, channels_last, the SDPA kernels allowed on CUDA), one validation sample (the sampler and
the VAE decode on CUDA, CPU-seeded noise moved over) and one encode batch (pinned upload, the VAE
encoder on CUDA). Not covered, because the CPU-only build cannot run it on fake CUDA tensors (see
tests/fake_cuda.py): the backward pass (zero gradients of each parameter's shape stand in for it),
the order of work between CUDA streams and events, page-locked memory, values.
"""

import numpy as np
import pytest
import torch

import sd.data.encode
import sd.lora.adapters
import sd.model
import sd.sampling
import sd.train.modes
import sd.train.step
from sd.distributed import Dist
from sd.train.config import TrainConfig

from fake_cuda import fake_cuda

CUDA = torch.device("cuda", 0)


def config(**fields) -> TrainConfig:
    values = dict(unet="tiny", text_encoder="tiny", vae="tiny", batch_size=2, grad_accum=2, precision="bf16",
                  grad_checkpointing=True, channels_last=True, ema_decay=0.999, datasets=[])
    return TrainConfig(**{**values, **fields})


def train_one_step(cfg: TrainConfig, steps: int = 1, syncs: list | None = None):
    """Build the trainer's step on CUDA and run ``steps`` optimizer steps; returns the step and the last
    one's result. ``syncs``: where the host would wait for the GPU, noted from the second step on
    (building and the first step, which creates the optimizer's state, copy weights over)."""
    holder = {}

    def backward(loss):  # the stand-in for autograd's engine: gradients of the parameters' shapes, on their device
        assert loss.device == CUDA and loss.dim() == 0 and loss.requires_grad  # the forward recorded its graph
        for parameter in [*holder["unet"].parameters(), *holder["text_encoder"].parameters()]:
            if parameter.requires_grad:
                parameter.grad = torch.zeros_like(parameter)

    with fake_cuda(backward, syncs):
        d = Dist.single(CUDA)
        text_encoder = holder["text_encoder"] = sd.model.load_text_encoder("tiny")
        unet = holder["unet"] = sd.model.build_unet("tiny", grad_checkpointing=cfg.grad_checkpointing,
                                                    channels_last=cfg.channels_last).to(d.device).train()
        mode = sd.train.modes.mode_of(cfg)
        mode.estimate_before_data(unet, text_encoder)  # a token: zeros
        unet = holder["unet"] = mode.estimate_attach(unet, text_encoder)
        step = sd.train.step.build_step(cfg, d, unet, text_encoder, torch.full((1, 77), 49407), 0.18215)
        ids = torch.randint(0, 49407 + cfg.embedding.vectors, (2, 77))
        if cfg.cache_text_embeddings:  # as sd.train.run.cache_text_embeddings: built on the GPU, kept on the host
            step.text_cache = sd.train.step.TextCache.build(step.text_encoder, ids, cfg.precision, d.device)
            step.text_encoder.to("cpu")
        batches = [(torch.randn(2, 4, 8, 8).half(), ids) for _ in range(cfg.grad_accum)]
        with sd.model.attention_context(d.device, cfg.attention):
            for i in range(steps):
                if syncs is not None and i == 1:
                    syncs.clear()
                result = sd.train.step.train_step(step, batches, i)
            waited = list(syncs or [])
            sd.train.step.read_results([result])  # read while the fake tensors' stand-ins are in place
            if syncs is not None:
                syncs[:] = waited
    return step, result


@pytest.mark.parametrize("ema_device", [pytest.param("same", marks=pytest.mark.slow),  # 9 s each: the full suite's
                                        pytest.param("cpu", marks=pytest.mark.slow)])
def test_a_training_step_keeps_every_tensor_on_its_device(ema_device):
    """And the host never waits for the GPU in a step, but where an EMA in host memory waits for its copies
    and then reads whether the step was skipped."""
    syncs = []
    step, result = train_one_step(config(ema_device=ema_device, ema_update_every=1), steps=3, syncs=syncs)
    assert syncs == ([] if ema_device == "same" else ["__bool__() of a () CUDA tensor"] * 2)
    assert result["bad"] is False and result["stop"] is False  # zeros read back: a finite step, applied
    assert {p.device for p in step.unet.parameters()} == {CUDA}
    assert {p.grad.device for p in step.unet.parameters()} == {CUDA}
    state = [t for s in step.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert state and {t.device for t in state} == {CUDA}  # fused AdamW's moments and steps, on the GPU
    assert step.optimizer.defaults.get("fused") is True
    assert step.noise_generator.device == CUDA
    shadow = {t.device.type for t in step.ema.shadow}
    assert shadow == ({"cpu"} if ema_device == "cpu" else {"cuda"})
    if ema_device == "cpu":  # the staging buffers the GPU weights are copied into
        assert {t.device.type for t in step.ema.staging} == {"cpu"}
    assert step.unet.conv_in.weight.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("fields", [pytest.param(dict(attention="cudnn"), id="cudnn", marks=pytest.mark.slow),
                                    pytest.param(dict(bf16_weights=True), id="bf16-weights", marks=pytest.mark.slow)])
def test_a_step_with_a_speed_lever_stays_on_the_device_without_waiting(fields):
    """attention: cudnn; bf16_weights (bf16 parameters, their fp32 masters in fused AdamW and the EMA: the
    gradients copied in and the weights copied out by foreach kernels, no host read)."""
    syncs = []
    step, result = train_one_step(config(**fields), steps=3, syncs=syncs)
    assert syncs == [] and result["bad"] is False
    assert {p.grad.device for p in step.unet.parameters()} == {CUDA}
    if fields.get("bf16_weights"):
        masters = step.optimizer.master_weights.master
        assert {p.dtype for p in step.unet.parameters()} == {torch.bfloat16}
        assert {(m.dtype, m.device) for m in masters} == {(torch.float32, CUDA)}
        assert all(m.grad is None for m in masters)  # the fp32 gradients live from the backward to the update
        assert step.optimizer.defaults.get("fused") is True


@pytest.mark.parametrize("fields", [
    pytest.param(dict(lora_rank=4, lora_dropout=0.1, lora_text_encoder=True, lora_targets=["attention", "resnet"],
                      optimizer="adamw8bit"), id="text-adapter-8bit", marks=pytest.mark.slow),  # 12 s: the full suite's
    pytest.param(dict(lora_rank=4, cache_text_embeddings=True, noise_offset=0.05, class_dir="x", ema_device="cpu"),
                 id="cached-prompts-prior", marks=pytest.mark.slow),
])
def test_a_lora_step_keeps_every_tensor_on_its_device(fields):
    """8-bit AdamW has no skip flag and an EMA in host memory waits for its copies: each reads whether
    the step was skipped, the one wait of a step (the cached prompts' lookup does not block)."""
    syncs = []
    step, result = train_one_step(config(**fields), steps=3, syncs=syncs)
    assert syncs == ["__bool__() of a () CUDA tensor"] * 2
    assert result["bad"] is False
    adapters = [p for p in step.trainable]
    assert adapters and all(sd.lora.adapters.is_adapter_name(n) for n, p in step.unet.named_parameters() if p.requires_grad)
    assert {p.device for p in adapters} == {CUDA} and {p.dtype for p in adapters} == {torch.float32}
    assert {p.dtype for n, p in step.unet.named_parameters() if not p.requires_grad} == {torch.bfloat16}
    state = [t for s in step.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert state and {t.device for t in state} == {CUDA}
    assert {t.device.type for t in step.ema.shadow} == ({"cpu"} if fields.get("ema_device") == "cpu" else {"cuda"})
    if fields.get("cache_text_embeddings"):
        assert {p.device.type for p in step.text_encoder.parameters()} == {"cpu"}
        assert step.text_cache.embeddings.device.type == "cpu"
    else:
        assert any(p.requires_grad for p in step.text_encoder.parameters())


def test_a_validation_sample_and_an_encode_batch_run_on_cuda():
    with fake_cuda():
        unet = sd.model.build_unet("tiny").to(CUDA).eval()
        vae, text_encoder = sd.model.load_vae("tiny").to(CUDA), sd.model.load_text_encoder("tiny").to(CUDA)
        pipe = sd.sampling.Pipeline(unet, vae, text_encoder, sd.model.load_tokenizer("tiny"), "epsilon")
        with sd.model.attention_context(CUDA), torch.autocast("cuda", dtype=torch.bfloat16):
            images = sd.sampling.generate(pipe, "a photo", "", [1, 2], steps=2, cfg=7.5, height=64, width=64,
                                          batch_size=2, device=CUDA)
        encoder_vae = sd.model.load_vae("tiny").to(device=CUDA, dtype=torch.bfloat16)  # as encode_latents.main
        encoder = sd.data.encode.Encoder(encoder_vae, CUDA, torch.bfloat16, compile_encoder=False, flip=True)
        latents, flipped = encoder([np.zeros((64, 64, 3), np.uint8)] * 3)
    assert [image.shape for image in images] == [(64, 64, 3)] * 2
    assert (latents.device, latents.dtype, tuple(latents.shape)) == (CUDA, torch.float16, (3, 4, 8, 8))
    assert flipped.device == CUDA


def test_a_cpu_only_assumption_fails_here(monkeypatch):
    """Two deliberately broken versions of CFG dropout, each a bug that only shows on a GPU."""
    def mask_drawn_on_the_cpu(hidden, empty, p, generator):  # a CUDA generator for a CPU tensor
        drop = torch.rand(hidden.shape[0], generator=generator) < p
        return torch.where(drop[:, None, None], empty, hidden), drop

    monkeypatch.setattr(sd.train.step, "apply_cfg_dropout", mask_drawn_on_the_cpu)
    with pytest.raises(RuntimeError, match="a generator on cuda:0 used for a tensor on cpu"):
        train_one_step(config())

    def mask_left_on_the_cpu(hidden, empty, p, generator):  # a CPU mask selecting between CUDA tensors
        drop = torch.rand(hidden.shape[0], generator=generator, device=generator.device).cpu() < p
        return torch.where(drop[:, None, None], empty.to(hidden.dtype), hidden), drop

    monkeypatch.setattr(sd.train.step, "apply_cfg_dropout", mask_left_on_the_cpu)
    with pytest.raises(Exception, match="(?i)device"):
        train_one_step(config())



@pytest.mark.slow  # over 7 s on a 2-core CPU: out of make check
def test_fp16_steps_with_a_trained_text_adapter_never_make_the_host_wait_for_the_gpu():
    """fp16 with its loss scaler, a text-encoder adapter trained (CFG dropout on the device's ids) and
    fused AdamW: the skip decision, overflow included, stays on the device."""
    syncs = []
    step, _ = train_one_step(config(precision="fp16", grad_checkpointing=False, lora_rank=4, lora_text_encoder=True,
                                    cfg_dropout=0.5), steps=3, syncs=syncs)
    assert step.scaler.is_enabled() and step.text_trains
    assert syncs == []


def test_a_textual_inversion_step_trains_the_token_rows_on_the_gpu_without_waiting_for_it():
    """The new rows are the only parameter that trains; the embedding picks them or the base rows on the
    device (no read of whether a batch holds a new id), and the EMA averages them alone."""
    syncs = []
    step, result = train_one_step(config(embedding_token="<t>", embedding_init="dog", embedding_vectors=2,
                                         init_from="owner/base", cfg_dropout=0.5), steps=3, syncs=syncs)
    assert syncs == [] and result["bad"] is False
    (rows,) = step.trainable
    assert rows.shape == (2, 64) and rows.device == CUDA and rows.dtype == torch.float32
    assert step.text_trains and not any(p.requires_grad for p in step.unet.parameters())
    assert {p.dtype for p in step.unet.parameters()} == {torch.bfloat16}
    assert step.ema is None  # no copy of the frozen UNet
    assert [t.shape for t in step.text_ema.shadow] == [(2, 64)] and step.text_ema.shadow[0].device == CUDA
