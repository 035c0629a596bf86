"""The ControlNet beside a frozen UNet (sd.controlnet.model): a new one changes nothing, a training step
trains it alone, and our sampling with it equals diffusers' StableDiffusionControlNetPipeline."""

import copy
import re

import numpy as np
import pytest
import torch

import sd.controlnet.mode
import sd.controlnet.model
import sd.model
import sd.sampling
import sd.train.step
from sd.distributed import Dist
from sd.train.config import ConfigError, TrainConfig

import global_rngs

SIZE = 64  # pixels: latents of 8 x 8


@pytest.fixture(scope="module")
def parts():
    """The tiny base: UNet, text encoder, VAE, tokenizer."""
    return (sd.model.build_unet("tiny", seed=0, from_scratch=False).eval(), sd.model.load_text_encoder("tiny"),
            sd.model.load_vae("tiny"), sd.model.load_tokenizer("tiny"))


@torch.no_grad()
def trained_looking(controlnet, seed=1):
    """``controlnet`` with its zero-initialised convolutions (the outputs, the conditioning embedding's last)
    drawn at random, as after training: its residuals are not zero and depend on the control image."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in controlnet.named_parameters():
        if name.startswith(("controlnet_down_blocks", "controlnet_mid_block", "controlnet_cond_embedding.conv_out")):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return controlnet


def control_image(seed=0):
    """A square of white on black at a seeded place, ``(1, 3, SIZE, SIZE)`` in [0, 1]."""
    rng = np.random.default_rng(seed)
    image = torch.zeros(1, 3, SIZE, SIZE)
    x, y = rng.integers(0, SIZE // 2, size=2)
    image[..., y : y + SIZE // 2, x : x + SIZE // 2] = 1.0
    return image


def unet_call(model, **kwargs):
    generator = torch.Generator().manual_seed(0)
    sample, context = torch.randn(2, 4, 8, 8, generator=generator), torch.randn(2, 77, 64, generator=generator)
    with torch.no_grad():
        return model(sample, torch.tensor([10, 700]), encoder_hidden_states=context, **kwargs).sample


def test_a_new_controlnet_leaves_the_prediction_as_it_was(parts):
    unet = parts[0]
    model = sd.controlnet.model.ControlledUNet(unet, sd.controlnet.model.new_controlnet(unet, seed=0))
    control = torch.cat([control_image(0), control_image(1)])
    assert torch.equal(unet_call(model, controlnet_cond=control), unet_call(unet))
    trained_looking(model.controlnet)
    changed = unet_call(model, controlnet_cond=control)
    assert (changed - unet_call(unet)).abs().max() > 1e-3  # the residuals reach the prediction
    with model.controlling(control):  # the samplers' call: the bound image
        assert torch.equal(unet_call(model), changed)
    assert not torch.equal(unet_call(model, controlnet_cond=torch.zeros_like(control)), changed)


def test_a_new_controlnet_copies_the_encoder_and_is_seeded(parts):
    unet = parts[0]
    first, second = (sd.controlnet.model.new_controlnet(unet, seed=s) for s in (3, 3))
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        assert torch.equal(a, b), name
    assert torch.equal(first.state_dict()["conv_in.weight"], unet.state_dict()["conv_in.weight"])
    other = sd.controlnet.model.new_controlnet(unet, seed=4).state_dict()["controlnet_cond_embedding.conv_in.weight"]
    assert not torch.equal(other, first.state_dict()["controlnet_cond_embedding.conv_in.weight"])
    with global_rngs.left_alone():
        sd.controlnet.model.new_controlnet(unet, seed=4)


def test_control_dropout_blanks_whole_images_at_its_rate():
    control = torch.full((4000, 3, 2, 2), 255, dtype=torch.uint8)
    generator = torch.Generator().manual_seed(0)
    pixels = sd.controlnet.model.control_batch(control, torch.device("cpu"), 0.25, generator)
    per_image = pixels.flatten(1)
    assert set(per_image.min(1).values.tolist()) == {0.0, 1.0} and torch.equal(per_image.min(1).values,
                                                                              per_image.max(1).values)
    assert abs(float((per_image[:, 0] == 0).float().mean()) - 0.25) < 0.03
    assert torch.equal(sd.controlnet.model.control_batch(control[:3], torch.device("cpu")), torch.ones(3, 3, 2, 2))


def build_step(parts, **fields):
    unet, encoder, _, tokenizer = copy.deepcopy(parts[0]).train(), parts[1], parts[2], parts[3]
    config = TrainConfig(unet="tiny", vae="tiny", text_encoder="tiny", precision="fp32", device="cpu", lr=1e-3,
                         warmup_steps=0, ema_decay=0.9, control="canny", init_from="base", **fields)
    model = sd.controlnet.model.attach(config, unet)
    trained_looking(model.controlnet)
    step = sd.train.step.build_step(config, Dist(0, 1, 0, torch.device("cpu"), True), model, encoder,
                                    sd.model.tokenize(tokenizer, [""]), 0.18215)
    return step, tokenizer


def test_a_step_trains_the_controlnet_alone_and_its_ema(parts):
    step, tokenizer = build_step(parts)
    model = step.unet
    base = {k: v.clone() for k, v in model.unet.state_dict().items()}
    before = {k: v.clone() for k, v in model.controlnet.state_dict().items()}
    assert step.ema.names and all(name.startswith(sd.controlnet.model.EMA_PREFIX) for name in step.ema.names)
    assert len(step.trainable) == len(list(model.controlnet.parameters()))
    control = (torch.rand(2, 3, SIZE, SIZE) * 255).to(torch.uint8)
    batch = (torch.randn(2, 4, 8, 8).half(), sd.model.tokenize(tokenizer, ["a", "b"]), control)
    result = sd.train.step.train_step(step, [batch], 0)
    assert not result["bad"] and np.isfinite(result["loss"]) and result["grad_norm"] > 0
    assert all(torch.equal(v, base[k]) for k, v in model.unet.state_dict().items())
    changed = [k for k, v in model.controlnet.state_dict().items() if not torch.equal(v, before[k])]
    assert len(changed) == len(before)  # every ControlNet weight moved (the zero convolutions included)


def test_a_step_without_its_control_images_is_an_error(parts):
    step, tokenizer = build_step(parts)
    with pytest.raises(ValueError, match="needs a control image"):
        sd.train.step.train_step(step, [(torch.randn(2, 4, 8, 8), sd.model.tokenize(tokenizer, ["a", "b"]))], 0)


@pytest.mark.parametrize("fields, message", [
    (dict(init_from=""), "set init_from (the base"),
    (dict(control="Canny"), "controlnet.control: the conditioning images' name"),
    (dict(control="mask"), "not 'mask'"),
    (dict(lora_rank=4), "does not train with a LoRA"),
    (dict(distill="lcm"), "distillation"),
    (dict(masked_loss=True), "masked_loss"),
    (dict(sharding="zero1"), "sharding: none"),
    (dict(validation_prompts=["a", "b"], validation_controls=["x.png"]), "one conditioning image per validation"),
    (dict(control="", control_dropout=0.5), "controlnet.dropout belongs to a ControlNet run"),
    (dict(control="", controlnet_from="cn"), "controlnet.init_from belongs to a ControlNet run"),
])
def test_a_bad_controlnet_setting_is_refused_by_name(fields, message):
    values = {**dict(unet="tiny", vae="tiny", text_encoder="tiny", control="canny", init_from="base",
                     validation_prompts=[]), **fields}
    config = TrainConfig(**values)
    with pytest.raises(ConfigError, match=re.escape(message)):
        sd.controlnet.mode.ControlNet.check(config, check_paths=True)
    if fields.get("init_from") != "":  # the same from the whole validation, before any work
        with pytest.raises(ConfigError, match=re.escape(message)):
            config.validate(check_paths=False)


# ------------------------------------------------------------------------------ diffusers as the reference


@pytest.mark.parametrize("cfg, scale", [(1.0, 1.0), (4.0, 0.7)])
def test_sampling_equals_diffusers_controlnet_pipeline(parts, cfg, scale):
    from diffusers import DDIMScheduler, StableDiffusionControlNetPipeline

    unet, encoder, vae, tokenizer = parts
    controlnet = trained_looking(sd.controlnet.model.new_controlnet(unet, seed=0)).eval()
    ours = sd.sampling.Pipeline(sd.controlnet.model.ControlledUNet(unet, controlnet), vae, encoder, tokenizer,
                                "epsilon")
    control = control_image(0)
    seeds = [5, 6]
    images = sd.sampling.generate(ours, "a red circle", "a blue square", seeds, steps=4, cfg=cfg, height=SIZE,
                                  width=SIZE, batch_size=2, device=torch.device("cpu"), control=control,
                                  control_scale=scale)
    pipe = StableDiffusionControlNetPipeline(
        vae=vae, text_encoder=encoder, tokenizer=tokenizer, unet=unet, controlnet=controlnet,
        scheduler=sd.model.build_noise_scheduler("epsilon", DDIMScheduler), safety_checker=None,
        feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    from PIL import Image

    pil = Image.fromarray((control[0].permute(1, 2, 0).numpy() * 255).astype(np.uint8))
    theirs = pipe("a red circle", image=pil, negative_prompt="a blue square", num_inference_steps=4,
                  guidance_scale=cfg, controlnet_conditioning_scale=scale, height=SIZE, width=SIZE,
                  num_images_per_prompt=2, latents=sd.sampling.initial_noise(seeds, (4, 8, 8)),
                  output_type="np").images
    theirs = (theirs * 255).round().astype(np.uint8)
    difference = max(np.abs(a.astype(int) - b.astype(int)).max() for a, b in zip(images, theirs))
    assert difference <= 1, difference  # float rounding only
    plain = sd.sampling.generate(sd.sampling.Pipeline(unet, vae, encoder, tokenizer, "epsilon"), "a red circle",
                                 "a blue square", seeds, steps=4, cfg=cfg, height=SIZE, width=SIZE, batch_size=2,
                                 device=torch.device("cpu"))
    assert max(np.abs(a.astype(int) - b.astype(int)).max() for a, b in zip(images, plain)) > 8  # control counts


@pytest.mark.slow
def test_a_controlnet_step_runs_on_cuda_without_waiting_for_it():
    """The frozen base in bf16 and the ControlNet on the GPU, the control images' dropout drawn there: the host
    never waits in a step (the fused AdamW and the EMA skip on the device)."""
    from fake_cuda import fake_cuda, steady_steps, zero_gradients

    holder, syncs = {}, []
    cuda = torch.device("cuda", 0)
    config = TrainConfig(unet="tiny", text_encoder="tiny", vae="tiny", precision="bf16", datasets=[], batch_size=2,
                         control="canny", control_dropout=0.5, init_from="base", ema_decay=0.99)
    with fake_cuda(zero_gradients(holder), syncs):
        model = holder["model"] = sd.controlnet.model.attach(config, sd.model.build_unet("tiny").to(cuda).train())
        encoder = sd.model.load_text_encoder("tiny")
        step = sd.train.step.build_step(config, Dist.single(cuda), model, encoder, torch.full((1, 77), 49407), 0.18)
        batch = [(torch.randn(2, 4, 8, 8).half(), torch.randint(0, 49407, (2, 77)),
                  torch.zeros(2, 3, 64, 64, dtype=torch.uint8))]
        waited, result = steady_steps(step, batch, syncs)
        sd.train.step.read_results([result])
    assert waited == []
    assert {(p.device, p.dtype) for p in model.unet.parameters()} == {(cuda, torch.bfloat16)}
    assert {(p.device, p.dtype) for p in model.controlnet.parameters()} == {(cuda, torch.float32)}
    assert {t.device for t in step.ema.shadow} == {cuda}


def test_a_damaged_or_oversized_control_image_is_one_error_naming_the_file(tmp_path):
    import struct
    import zlib

    from PIL import Image

    good = tmp_path / "good.png"
    Image.fromarray((control_image(0)[0, 0].numpy() * 255).astype(np.uint8)).save(good)
    pixels = sd.controlnet.model.read_control_image(good, 32, 48)
    assert pixels.shape == (1, 3, 48, 32) and 0 <= float(pixels.min()) and float(pixels.max()) <= 1
    cut = tmp_path / "cut.png"
    cut.write_bytes(good.read_bytes()[:-40])

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    huge = tmp_path / "huge.png"  # a header declaring 100000 x 100000 pixels, and no pixels
    huge.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 100000, 100000, 8, 0, 0, 0, 0))
                     + chunk(b"IEND", b""))
    text = tmp_path / "text.png"
    text.write_text("not an image")
    for path, reason in ((cut, "truncated_image"), (huge, "too_large"), (text, "undecodable")):
        with pytest.raises(ValueError, match=f"control image {re.escape(str(path))}: {reason}"):
            sd.controlnet.model.read_control_image(path)
