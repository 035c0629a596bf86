import math
import random

import numpy as np
import pytest
import torch

import sd.model as M
import sd.sampling
import sd.tokenizer
import sd.train.ema

import global_rngs

# ----------------------------------------------------------------------------------------- UNet


def test_sd1_unet_has_exactly_the_sd1_parameter_count():
    with torch.device("meta"):
        unet = M.build_unet("sd1")
    assert M.count_parameters(unet) == 859_520_964


def test_sd1_zero_init_covers_every_output_projection():
    with torch.device("meta"):
        unet = M.build_unet("sd1", from_scratch=False)
    names = M.zero_init_output_projections(unet)
    # SD 1.x: 22 ResNet blocks, 16 transformer blocks (each with self- and cross-attention).
    assert sum(n.endswith(".conv2") for n in names) == 22
    assert sum(n.endswith("attn1.to_out.0") for n in names) == 16
    assert sum(n.endswith("attn2.to_out.0") for n in names) == 16
    assert sum(n.endswith("ff.net.2") for n in names) == 16
    assert sum(n.endswith(".proj_out") for n in names) == 16
    assert names[-1] == "conv_out"
    assert len(names) == 87


def _tiny_inputs(batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(batch, 4, 8, 8, generator=g)
    context = torch.randn(batch, 77, 64, generator=g)
    timesteps = torch.randint(0, 1000, (batch,), generator=g)
    return latents, timesteps, context


def test_from_scratch_tiny_unet_zeroes_projections_and_outputs_exact_zero():
    unet = M.build_unet("tiny", seed=0)
    modules = dict(unet.named_modules())
    names = M.zero_init_output_projections(M.build_unet("tiny", seed=0, from_scratch=False))
    assert len(names) == 8 + 4 * 4 + 1  # 8 ResNets, 4 transformers x 4 projections, conv_out
    for name in names:
        layer = modules[name]
        assert torch.count_nonzero(layer.weight) == 0, name
        assert layer.bias is None or torch.count_nonzero(layer.bias) == 0, name
    # The rest of the network is randomly initialised, not zero.
    assert torch.count_nonzero(unet.conv_in.weight) == unet.conv_in.weight.numel()
    latents, timesteps, context = _tiny_inputs()
    out = unet(latents, timesteps, encoder_hidden_states=context).sample
    assert out.shape == latents.shape
    assert torch.count_nonzero(out) == 0


def test_zero_init_does_not_block_learning():
    unet = M.build_unet("tiny", seed=0)
    latents, timesteps, context = _tiny_inputs()
    opt = torch.optim.SGD(unet.parameters(), lr=0.1)
    loss = (unet(latents, timesteps, encoder_hidden_states=context).sample - latents).pow(2).mean()
    loss.backward()
    opt.step()
    out = unet(latents, timesteps, encoder_hidden_states=context).sample
    assert out.abs().max() > 0


def test_not_from_scratch_keeps_random_output_layers():
    unet = M.build_unet("tiny", seed=0, from_scratch=False)
    assert torch.count_nonzero(unet.conv_out.weight) > 0


def test_seeded_build_is_reproducible_and_leaves_global_rng_alone():
    with global_rngs.left_alone():
        a = M.build_unet("tiny", seed=0)
        M.load_vae("tiny")
        M.load_text_encoder("tiny")
    b = M.build_unet("tiny", seed=0)
    c = M.build_unet("tiny", seed=1)
    assert torch.equal(a.conv_in.weight, b.conv_in.weight)
    assert not torch.equal(a.conv_in.weight, c.conv_in.weight)


def test_the_global_rng_check_fails_on_a_draw_from_any_of_them():
    for draw in (lambda: torch.rand(1), lambda: np.random.rand(), lambda: random.random()):
        with pytest.raises(AssertionError, match="drawn from"):
            with global_rngs.left_alone():
                draw()


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="sd1"):
        M.build_unet("sd2")


def test_grad_checkpointing_and_channels_last_switches_keep_the_math():
    base = M.build_unet("tiny", seed=0, from_scratch=False)
    switched = M.build_unet("tiny", seed=0, from_scratch=False, grad_checkpointing=True, channels_last=True)
    assert switched.is_gradient_checkpointing and not base.is_gradient_checkpointing
    assert switched.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    latents, timesteps, context = _tiny_inputs()
    switched.train()
    base.train()
    grads = []
    for unet in (base, switched):
        out = unet(latents, timesteps, encoder_hidden_states=context).sample
        out.square().mean().backward()
        grads.append(unet.conv_in.weight.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)
    M.configure_unet(switched, grad_checkpointing=False, channels_last=False)
    assert not switched.is_gradient_checkpointing
    assert switched.conv_in.weight.is_contiguous()


def test_attention_uses_sdpa_with_kernels_by_device():
    from diffusers.models.attention_processor import AttnProcessor2_0
    from torch.nn.attention import SDPBackend

    unet = M.build_unet("tiny", seed=0)
    processors = unet.attn_processors
    assert processors and all(isinstance(p, AttnProcessor2_0) for p in processors.values())
    assert M.sdpa_backends("cpu") == [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    cuda = M.sdpa_backends("cuda")
    assert SDPBackend.FLASH_ATTENTION in cuda and SDPBackend.EFFICIENT_ATTENTION in cuda
    assert SDPBackend.MATH not in cuda
    # the config's attention on a GPU: the kernels in the order tried, math only when asked for
    assert M.sdpa_backends("cuda", "cudnn") == [SDPBackend.CUDNN_ATTENTION, *cuda]
    assert M.sdpa_backends("cuda", "flash") == [SDPBackend.FLASH_ATTENTION]
    assert M.sdpa_backends("cuda", "efficient") == [SDPBackend.EFFICIENT_ATTENTION]
    assert M.sdpa_backends("cuda", "math") == [SDPBackend.MATH]
    assert M.sdpa_backends("cpu", "cudnn") == M.sdpa_backends("cpu")  # a GPU setting
    with pytest.raises(ValueError, match="attention: 'xformers' is not one of auto, cudnn"):
        M.sdpa_backends("cuda", "xformers")
    trained = M.build_unet("tiny", seed=0, from_scratch=False)  # a non-zero output to compare
    latents, timesteps, context = _tiny_inputs()
    with M.attention_context("cpu"):
        out = trained(latents, timesteps, encoder_hidden_states=context).sample
    with torch.nn.attention.sdpa_kernel([SDPBackend.MATH]):
        reference = trained(latents, timesteps, encoder_hidden_states=context).sample
    assert out.shape == latents.shape and out.abs().mean() > 0.01
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------- frozen parts, tokenizer


def test_tokenizer_is_the_real_clip_bpe():
    tokenizer = M.load_tokenizer("tiny")
    assert tokenizer("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]
    assert len(tokenizer) == 49408
    ids = M.tokenize(tokenizer, ["a photo of a cat", "word " * 200])
    assert ids.shape == (2, 77)
    assert ids[0, 7:].eq(49407).all()  # padded with the end token, as SD 1.x was trained
    assert ids[1, 0] == 49406 and ids[1, -1] == 49407  # truncated, still closed by the end token


def test_tokenizer_builds_from_the_wheel_into_an_empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SD_CACHE_DIR", str(tmp_path))
    folder = sd.tokenizer.clip_tokenizer_folder()
    assert folder == tmp_path / "clip_tokenizer"
    merges = (folder / "merges.txt").read_text(encoding="utf-8").splitlines()
    assert merges[0].startswith("#version") and len(merges) == 1 + 48894
    tokenizer = M.load_tokenizer("tiny")
    assert tokenizer("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]


def test_tiny_text_encoder_gives_last_hidden_state_and_is_frozen():
    encoder = M.load_text_encoder("tiny")
    assert not any(p.requires_grad for p in encoder.parameters()) and not encoder.training
    ids = M.tokenize(M.load_tokenizer("tiny"), ["a red circle", ""])
    hidden = M.encode_prompt_ids(encoder, ids)
    assert hidden.shape == (2, 77, M.UNET_PRESETS["tiny"]["cross_attention_dim"])
    assert not hidden.requires_grad
    again = M.encode_prompt_ids(M.load_text_encoder("tiny"), ids)
    assert torch.equal(hidden, again)  # seeded: the same weights every time


def test_tiny_vae_keeps_the_sd_interface():
    vae = M.load_vae("tiny")
    assert vae.config.latent_channels == 4
    assert vae.config.scaling_factor == pytest.approx(0.18215)
    images = torch.rand(2, 3, 64, 48) * 2 - 1
    with torch.no_grad():
        latents = vae.encode(images).latent_dist.mean
        decoded = vae.decode(latents).sample
    assert latents.shape == (2, 4, 8, 6)
    assert decoded.shape == images.shape


def test_loaders_read_local_folders_and_pipeline_layouts(tmp_path):
    vae, encoder = M.load_vae("tiny", seed=3), M.load_text_encoder("tiny", seed=3)
    vae.save_pretrained(tmp_path / "vae_only")
    vae.save_pretrained(tmp_path / "pipeline" / "vae")
    encoder.save_pretrained(tmp_path / "pipeline" / "text_encoder")
    M.load_tokenizer("tiny").save_pretrained(tmp_path / "pipeline" / "tokenizer")
    for source in (tmp_path / "vae_only", tmp_path / "pipeline"):
        loaded = M.load_vae(str(source))
        assert torch.equal(loaded.encoder.conv_in.weight, vae.encoder.conv_in.weight)
    loaded_encoder = M.load_text_encoder(str(tmp_path / "pipeline"))
    ids = torch.tensor([[49406, 320, 49407]])
    assert torch.equal(M.encode_prompt_ids(loaded_encoder, ids), M.encode_prompt_ids(encoder, ids))
    tokenizer = M.load_tokenizer(str(tmp_path / "pipeline"))
    assert tokenizer("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]


# ------------------------------------------------------------------------- schedule and the loss


def _hand_alphas_cumprod():
    """alpha-bar by plain Python, independent of the torch code under test."""
    lo, hi = math.sqrt(0.00085), math.sqrt(0.012)
    product, out = 1.0, []
    for i in range(1000):
        beta = (lo + (hi - lo) * i / 999) ** 2
        product *= 1 - beta
        out.append(product)
    return out


def test_schedule_matches_hand_computation_and_diffusers():
    ours = M.ddpm_alphas_cumprod()
    hand = torch.tensor(_hand_alphas_cumprod(), dtype=torch.float64)
    torch.testing.assert_close(ours, hand, rtol=1e-12, atol=1e-12)
    assert ours[0].item() == pytest.approx(0.99915, abs=1e-12)
    assert ours[999].item() == pytest.approx(0.004660098513, rel=1e-9)
    diffusers_values = M.build_noise_scheduler().alphas_cumprod
    torch.testing.assert_close(ours.float(), diffusers_values, rtol=1e-5, atol=1e-6)


# Hand-computed with the formulas of the Min-SNR paper, gamma = 5:
# t: (snr, epsilon weight min(snr,5)/snr, v weight min(snr,5)/(snr+1))
MIN_SNR_TABLE = {
    0: (1175.470588, 0.004253615573, 0.00425),
    100: (8.453893711, 0.5914434426, 0.5288826121),
    250: (2.065534618, 1.0, 0.6737926252),
    500: (0.381850441, 1.0, 0.2763326838),
    999: (0.004681916706, 1.0, 0.004660098513),
}


def test_min_snr_weights_match_hand_computed_values():
    alphas = M.ddpm_alphas_cumprod()
    timesteps = torch.tensor(sorted(MIN_SNR_TABLE))
    snr = M.snr(timesteps, alphas)
    eps = M.min_snr_weights(timesteps, alphas, "epsilon", 5.0)
    v = M.min_snr_weights(timesteps, alphas, "v_prediction", 5.0)
    for i, t in enumerate(timesteps.tolist()):
        want_snr, want_eps, want_v = MIN_SNR_TABLE[t]
        assert snr[i].item() == pytest.approx(want_snr, rel=1e-8)
        assert eps[i].item() == pytest.approx(want_eps, rel=1e-6)
        assert v[i].item() == pytest.approx(want_v, rel=1e-6)
    # The v weight is never the epsilon formula: at t=250 it is a, not 1.
    assert v[2].item() != pytest.approx(eps[2].item())


def test_min_snr_against_the_formula_at_every_timestep():
    hand = _hand_alphas_cumprod()
    alphas = M.ddpm_alphas_cumprod()
    timesteps = torch.arange(0, 1000, 37)
    for gamma in (1.0, 5.0, 20.0):
        eps = M.min_snr_weights(timesteps, alphas, "epsilon", gamma)
        v = M.min_snr_weights(timesteps, alphas, "v_prediction", gamma)
        for i, t in enumerate(timesteps.tolist()):
            s = hand[t] / (1 - hand[t])
            assert eps[i].item() == pytest.approx(min(s, gamma) / s, rel=1e-6)
            assert v[i].item() == pytest.approx(min(s, gamma) / (s + 1), rel=1e-6)


def test_diffusion_loss_is_weighted_per_sample_mse_in_fp32():
    alphas = M.ddpm_alphas_cumprod()
    g = torch.Generator().manual_seed(0)
    pred = torch.randn(3, 4, 8, 8, generator=g).bfloat16()
    target = torch.randn(3, 4, 8, 8, generator=g)
    timesteps = torch.tensor([0, 100, 999])
    loss = M.diffusion_loss(pred, target, timesteps, alphas, "epsilon", 5.0)
    assert loss.dtype == torch.float32 and loss.shape == (3,)
    mse = (pred.float() - target).pow(2).mean(dim=(1, 2, 3))
    weights = torch.tensor([MIN_SNR_TABLE[t][1] for t in (0, 100, 999)])
    torch.testing.assert_close(loss, mse * weights, rtol=1e-6, atol=0)
    plain = M.diffusion_loss(pred, target, timesteps, alphas, "epsilon", None)
    torch.testing.assert_close(plain, mse, rtol=0, atol=0)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_a_mask_of_zeros_on_half_the_latent_takes_that_half_out_of_the_loss_and_its_gradient(prediction_type):
    alphas = M.ddpm_alphas_cumprod()
    g = torch.Generator().manual_seed(2)
    pred = torch.randn(3, 4, 8, 8, generator=g, requires_grad=True)
    target = torch.randn(3, 4, 8, 8, generator=g)
    timesteps = torch.tensor([5, 400, 990])
    mask = torch.ones(3, 1, 8, 8, dtype=torch.float16)
    mask[..., 4:] = 0  # the right half of every sample
    loss = M.diffusion_loss(pred, target, timesteps, alphas, prediction_type, 5.0, mask)
    loss.sum().backward()
    assert (pred.grad[..., 4:] == 0).all() and (pred.grad[..., :4] != 0).all()
    # Min-SNR weights unchanged; the mean is over all elements: the kept half's loss, halved.
    kept = M.diffusion_loss(pred[..., :4].detach(), target[..., :4], timesteps, alphas, prediction_type, 5.0)
    torch.testing.assert_close(loss.detach(), kept / 2, rtol=1e-6, atol=0)


def test_without_a_mask_or_with_a_mask_of_ones_the_loss_is_bitwise_the_unmasked_one():
    alphas = M.ddpm_alphas_cumprod()
    g = torch.Generator().manual_seed(3)
    pred, target = torch.randn(4, 4, 8, 8, generator=g).bfloat16(), torch.randn(4, 4, 8, 8, generator=g)
    timesteps = torch.tensor([1, 250, 500, 999])
    mse = torch.nn.functional.mse_loss(pred.float(), target, reduction="none").mean(dim=(1, 2, 3))
    unmasked = mse * M.min_snr_weights(timesteps, alphas, "epsilon", 5.0)  # the formula before masks
    assert torch.equal(M.diffusion_loss(pred, target, timesteps, alphas, "epsilon", 5.0), unmasked)
    ones = torch.ones(4, 1, 8, 8, dtype=torch.float16)
    assert torch.equal(M.diffusion_loss(pred, target, timesteps, alphas, "epsilon", 5.0, ones), unmasked)


def test_v_target_and_noising_are_consistent():
    alphas = M.ddpm_alphas_cumprod()
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(4, 4, 8, 8, generator=g) * 4
    noise = torch.randn(4, 4, 8, 8, generator=g)
    timesteps = torch.tensor([1, 300, 600, 999])
    x_t = M.add_noise(x0, noise, timesteps, alphas)
    v = M.prediction_target(x0, noise, timesteps, alphas, "v_prediction")
    a = alphas[timesteps].float().view(-1, 1, 1, 1)
    torch.testing.assert_close(a.sqrt() * x_t - (1 - a).sqrt() * v, x0, rtol=1e-4, atol=1e-4)
    assert torch.equal(M.prediction_target(x0, noise, timesteps, alphas, "epsilon"), noise)
    with pytest.raises(ValueError, match="prediction_type"):
        M.prediction_target(x0, noise, timesteps, alphas, "sample")


def test_latent_scaling_round_trips():
    latents = torch.randn(2, 4, 8, 8)
    scaled = M.scale_latents(latents)
    torch.testing.assert_close(scaled, latents * 0.18215)
    torch.testing.assert_close(M.unscale_latents(scaled), latents)


def test_sample_timesteps_come_from_the_given_generator():
    a = M.sample_timesteps(1000, torch.Generator().manual_seed(5))
    b = M.sample_timesteps(1000, torch.Generator().manual_seed(5))
    assert torch.equal(a, b) and a.min() >= 0 and a.max() <= 999
    assert a.unique().numel() > 600  # spread over the range, not a constant


# ------------------------------------------------------------------------------------------ DDIM


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_ddim_matches_diffusers_ddim_scheduler(prediction_type):
    from diffusers import DDIMScheduler

    scheduler = M.build_noise_scheduler(prediction_type, DDIMScheduler)
    scheduler.set_timesteps(50)
    assert scheduler.timesteps.tolist() == sd.sampling.ddim_timesteps(50)
    alphas = M.ddpm_alphas_cumprod()
    g = torch.Generator().manual_seed(0)
    sample = torch.randn(2, 4, 8, 8, generator=g) * 3
    output = torch.randn(2, 4, 8, 8, generator=g)
    for t in (981, 501, 21, 1):
        ours = sd.sampling.ddim_step(sample, output, t, t - 20, alphas, prediction_type)
        theirs = scheduler.step(output, t, sample).prev_sample
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_ddim_step_never_clamps_large_latents():
    alphas = M.ddpm_alphas_cumprod()
    x0 = torch.full((1, 4, 8, 8), 4.0)
    x0[..., ::2] = -4.0
    noise = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    t = 501
    x_t = M.add_noise(x0, noise, torch.tensor([t]), alphas)
    # An oracle model predicts the true noise; the step must land on the true trajectory.
    x_prev = sd.sampling.ddim_step(x_t, noise, t, t - 20, alphas, "epsilon")
    expected = M.add_noise(x0, noise, torch.tensor([t - 20]), alphas)
    torch.testing.assert_close(x_prev, expected, rtol=1e-5, atol=1e-5)
    # The last step returns x0 itself (up to the schedule's final alpha-bar), values near +-4.
    x_last = sd.sampling.ddim_step(M.add_noise(x0, noise, torch.tensor([1]), alphas), noise, 1, -1, alphas, "epsilon")
    assert x_last.abs().max() > 3.9
    torch.testing.assert_close(x_last, M.add_noise(x0, noise, torch.tensor([0]), alphas), rtol=1e-5, atol=1e-5)


def test_guidance_scale_one_is_the_conditional_branch_and_negatives_matter():
    unet = M.build_unet("tiny", seed=0, from_scratch=False).eval()
    latents, _, cond = _tiny_inputs(batch=1, seed=1)
    _, _, negative = _tiny_inputs(batch=1, seed=2)
    empty = torch.zeros_like(cond)
    with torch.no_grad():
        only_cond = unet(latents, torch.tensor([500]), encoder_hidden_states=cond).sample
        only_neg = unet(latents, torch.tensor([500]), encoder_hidden_states=negative).sample
        at_one = sd.sampling.guided_prediction(unet, latents, 500, cond, negative, 1.0)
        guided = sd.sampling.guided_prediction(unet, latents, 500, cond, negative, 7.5)
        guided_empty = sd.sampling.guided_prediction(unet, latents, 500, cond, empty, 7.5)
    assert torch.equal(at_one, only_cond)
    torch.testing.assert_close(guided, only_neg + 7.5 * (only_cond - only_neg), rtol=1e-4, atol=1e-5)
    assert (guided - guided_empty).abs().max() > 1e-3


def test_ddim_sample_is_deterministic():
    unet = M.build_unet("tiny", seed=0, from_scratch=False).eval()
    latents, _, cond = _tiny_inputs(batch=2, seed=3)
    uncond = torch.zeros_like(cond)
    a = sd.sampling.sample_latents(unet, latents, cond, uncond, steps=5, cfg=3.0)
    b = sd.sampling.sample_latents(unet, latents, cond, uncond, steps=5, cfg=3.0)
    assert torch.equal(a, b)
    assert a.shape == latents.shape and torch.isfinite(a).all()
    assert not torch.equal(a, latents)


# ------------------------------------------------------------------------------------------- EMA


def _linear(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3)


def test_ema_after_k_updates_matches_the_closed_form():
    model = _linear()
    start = [p.detach().clone() for p in model.parameters()]
    ema = sd.train.ema.EMA(model, decay=0.9)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(2.0)
    k = 25
    for step in range(k):
        ema.update(model, step)
    # Constant live weights w: shadow_k = w + (shadow_0 - w) * prod_i decay_i.
    product = 1.0
    for step in range(k):
        product *= min(0.9, (1 + step) / (10 + step))
    for s0, shadow in zip(start, ema.shadow):
        expected = 2.0 + (s0.double() - 2.0) * product
        torch.testing.assert_close(shadow.double(), expected, rtol=1e-6, atol=1e-6)


def test_ema_tracks_changing_weights_like_the_recursion():
    model = _linear()
    ema = sd.train.ema.EMA(model, decay=0.999)
    reference = [p.detach().double().clone() for p in model.parameters()]
    g = torch.Generator().manual_seed(0)
    for step in range(12):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g))
        ema.update(model, step)
        d = sd.train.ema.ema_decay_at(step, 0.999)
        reference = [d * r + (1 - d) * p.detach().double() for r, p in zip(reference, model.parameters())]
    for r, s in zip(reference, ema.shadow):
        torch.testing.assert_close(s.double(), r, rtol=1e-5, atol=1e-6)
    assert sd.train.ema.ema_decay_at(0, 0.9999) == pytest.approx(0.1)
    assert sd.train.ema.ema_decay_at(10**7, 0.9999) == 0.9999


def test_ema_every_n_steps_on_cpu_uses_the_powered_decay():
    model = _linear()
    start = [p.detach().clone() for p in model.parameters()]
    ema = sd.train.ema.EMA(model, decay=0.5, device="cpu", update_every=3)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)
    applied = [ema.update(model, step) for step in range(6)]
    assert applied == [False, False, True, False, False, True]
    product = (sd.train.ema.ema_decay_at(2, 0.5) ** 3) * (sd.train.ema.ema_decay_at(5, 0.5) ** 3)
    for s0, shadow in zip(start, ema.shadow):
        torch.testing.assert_close(shadow, 1.0 + (s0 - 1.0) * product)


def test_ema_state_dict_round_trip_and_mismatch_errors():
    model = _linear()
    ema = sd.train.ema.EMA(model, decay=0.99)
    ema.update(model, 0)
    other = sd.train.ema.EMA(_linear(seed=1), decay=0.99)
    other.load_state_dict(ema.state_dict())
    for a, b in zip(ema.shadow, other.shadow):
        assert torch.equal(a, b)
    with pytest.raises(KeyError, match="missing"):
        other.load_state_dict({"weight": ema.shadow[0]})


def test_swapping_ema_weights_in_and_out_is_exact():
    model = M.build_unet("tiny", seed=0, from_scratch=False)
    ema = sd.train.ema.EMA(model, decay=0.9)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.1).add_(0.01)
    ema.update(model, 100)  # shadow now differs from the live weights
    live = [p.detach().clone() for p in model.parameters()]
    with ema.swapped_in(model):
        inside = [p.detach().clone() for p in model.parameters()]
    for p, before, swapped, shadow in zip(model.parameters(), live, inside, ema.shadow):
        assert torch.equal(p, before)  # bit for bit
        assert torch.equal(swapped, shadow)
    assert any(not torch.equal(a, b) for a, b in zip(live, inside))


class _CudaCalls:
    """Stands in for torch.cuda's Event and current_stream on a CPU-only build, logging each call."""

    def __init__(self, log):
        self.log = log

    def current_stream(self, device=None):
        return ("stream", torch.device(device))

    def Event(self):
        log = self.log

        class Event:
            def record(self, stream=None):
                log.append(("record", stream))

            def synchronize(self):
                log.append(("synchronize",))

        return Event()


def test_cpu_ema_of_cuda_weights_stages_into_pinned_buffers_once_and_waits_before_the_lerp(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    log = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func not in (torch.ops.aten.detach.default, torch.ops.prim.device.default):
                log.append((func, args, kwargs or {}))
            return func(*args, **(kwargs or {}))

    cuda = _CudaCalls(log)
    monkeypatch.setattr(torch.cuda, "Event", cuda.Event)
    monkeypatch.setattr(torch.cuda, "current_stream", cuda.current_stream)
    aten = torch.ops.aten
    with FakeTensorMode():  # cuda tensors on a CPU-only build
        model = torch.nn.Module()
        model.weight = torch.nn.Parameter(torch.zeros(3, 2, device="cuda"))
        model.bias = torch.nn.Parameter(torch.zeros(2, device="cuda"))
        params = list(model.parameters())
        ema = sd.train.ema.EMA(model, decay=0.9, device="cpu")
        assert [s.device.type for s in ema.shadow] == ["cpu", "cpu"]
        updates = []
        for step in range(3):
            log.clear()
            with Ops():
                ema.update(model, step)
            updates.append(list(log))
    first, *later = updates
    allocations = [op for op in first if op[0] is aten.empty.memory_format]
    assert len(allocations) == 2
    assert all(kw["pin_memory"] is True and kw["device"] == torch.device("cpu") and kw["dtype"] == torch.float32
               for _, _, kw in allocations)
    buffers = ema.staging
    assert [tuple(b.shape) for b in buffers] == [(3, 2), (2,)]
    for ops in [first[2:], *later]:  # every update: copies, an event after them, a wait, then the lerp
        assert [op[0] for op in ops] == [aten.copy_.default, aten.copy_.default, "record", "synchronize",
                                          aten._foreach_lerp_.Scalar]
        copies = ops[:2]
        assert all(args[0] is b and args[1].device == p.device and args[1].shape == p.shape and args[2] is True
                   for (_, args, _), b, p in zip(copies, buffers, params))  # into the same buffers, non-blocking
        assert ops[2][1] == ("stream", torch.device("cuda", 0))
        lerp_args = ops[4][1]
        assert all(a is s for a, s in zip(lerp_args[0], ema.shadow))
        assert all(a is b for a, b in zip(lerp_args[1], buffers))
    assert [op[4][1][2] for op in [first[2:], *later]] == pytest.approx([1 - 0.1, 1 - 2 / 11, 1 - 3 / 12])


def test_ema_of_other_dtype_weights_reuses_one_staging_buffer_and_stays_exact():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    ema = sd.train.ema.EMA(model, decay=0.9, device="cpu")
    reference = [p.detach().double() for p in model.parameters()]
    pointers = None
    for step in range(4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape).to(torch.bfloat16))
        ema.update(model, step)
        d = sd.train.ema.ema_decay_at(step, 0.9)
        reference = [d * r + (1 - d) * p.detach().double() for r, p in zip(reference, model.parameters())]
        pointers = pointers or [b.data_ptr() for b in ema.staging]
        assert [b.data_ptr() for b in ema.staging] == pointers
    assert not any(b.is_pinned() for b in ema.staging)  # pinned only for a CUDA source
    for r, s in zip(reference, ema.shadow):
        torch.testing.assert_close(s.double(), r, rtol=1e-6, atol=1e-6)


def test_ema_without_warmup_matches_the_constant_decay_closed_form():
    # An inherited EMA E0, live weights w_1..w_k: E_k = d^k E0 + sum_i (1 - d) d^(k - i) w_i.
    model = _linear()
    start = [p.detach().double().clone() for p in model.parameters()]
    ema = sd.train.ema.EMA(model, decay=0.9, warmup=False)
    g = torch.Generator().manual_seed(0)
    live = []
    for step in range(5):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g))
        live.append([p.detach().double().clone() for p in model.parameters()])
        ema.update(model, step)
    k, d = len(live), 0.9
    for j, (e0, shadow) in enumerate(zip(start, ema.shadow)):
        expected = d**k * e0 + sum((1 - d) * d ** (k - i) * w[j] for i, w in enumerate(live, start=1))
        torch.testing.assert_close(shadow.double(), expected, rtol=0, atol=1e-6)
    assert d**k == pytest.approx(0.59049)  # E0 keeps its weight (the warm-up would leave it 1e-3)


def test_ema_rejects_bad_settings():
    with pytest.raises(ValueError, match="decay"):
        sd.train.ema.EMA(_linear(), decay=1.0)
    with pytest.raises(ValueError, match="update_every"):
        sd.train.ema.EMA(_linear(), update_every=0)


@pytest.mark.slow
def test_training_flops_count_attention_in_full():
    # The layer-by-layer count of the SD 1.x UNet (forward + backward, attention included) is 2.41
    # TFLOP per image at 512 px and 0.54 at 256 px; without the attention matmuls it would be ~2.03.
    assert M.training_flops_per_image("sd1", 64) == pytest.approx(2.41e12, rel=0.005)
    assert M.training_flops_per_image("sd1", 32) == pytest.approx(0.54e12, rel=0.01)
    # Quadrupling the pixels of the tiny preset at least quadruples its work (attention grows faster).
    assert M.training_flops_per_image("tiny", 16) > 4 * M.training_flops_per_image("tiny", 8)


def test_grid_labels_hold_the_whole_prompt_wrapped_to_the_row(tmp_path):
    from PIL import Image

    import sd.sampling

    prompt = "a photo of a golden retriever on the beach"
    lines = sd.sampling.grid_label(prompt, 64)  # about 10 characters a line
    assert " ".join(lines) == prompt and all(len(line) <= 10 for line in lines)
    assert sd.sampling.grid_label("x " * 200, 64)[-1].endswith("...")  # at most 6 lines
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(5)]
    prompts = [prompt, "a cat", "a dog", "a red circle", "a blue square"]
    # One image per prompt (the validation grid): 64 px scaled to 128, three across and two down, each
    # under its own prompt wrapped to 128 px (about 21 characters a line).
    sd.sampling.save_grid(tmp_path / "g.png", list(zip(prompts, ([image] for image in images))))
    grid = np.asarray(Image.open(tmp_path / "g.png").convert("RGB"))
    label = 16 * len(sd.sampling.grid_label(prompt, 128))
    assert label < 16 * len(lines) and grid.shape == (2 * (label + 128), 3 * 128, 3)
    for row, image in enumerate(images):
        assert np.array_equal(sd.sampling.grid_cell(grid, row, 0, 64, 64, prompts), image)
    # Several images per prompt (SD_ImageGen.py's grid): a row each, the prompt across the row.
    sd.sampling.save_grid(tmp_path / "h.png", [(prompts[0], images[:2]), (prompts[1], images[2:4])])
    grid = np.asarray(Image.open(tmp_path / "h.png").convert("RGB"))
    assert grid.shape == (2 * (16 * len(sd.sampling.grid_label(prompt, 256)) + 128), 256, 3)
    for row, column, image in ((0, 0, images[0]), (0, 1, images[1]), (1, 0, images[2]), (1, 1, images[3])):
        assert np.array_equal(sd.sampling.grid_cell(grid, row, column, 64, 64, prompts[:2], images=2), image)


def test_an_ema_or_weights_file_holding_nan_is_refused_at_load_naming_the_tensor_and_nothing_is_loaded():
    import sd.formats

    model = _linear()
    ema = sd.train.ema.EMA(model, decay=0.9)
    before = [s.clone() for s in ema.shadow]
    state = {name: tensor.clone() for name, tensor in ema.state_dict().items()}
    last = list(state)[-1]
    state[last][0] = float("nan")
    with pytest.raises(ValueError, match=f"EMA tensor {last} holds non-finite values"):
        ema.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(before, ema.shadow))  # the checked tensors were not copied in
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    weights["weight"][0, 0] = float("inf")
    kept = model.weight.detach().clone()
    with pytest.raises(ValueError, match="damaged.safetensors: weight holds non-finite values"):
        sd.formats.load_into(model, weights, "damaged.safetensors")
    assert torch.equal(model.weight, kept)


def test_a_hub_id_loads_from_the_local_cache_alone_when_the_hub_cannot_be_reached(monkeypatch, tmp_path):
    """Offline, stage 04 without --tokenizer once retried the hub for four minutes before its error: the hub is
    now asked once for a connection (3 s at most) and, unreachable, the files come from the cache or not at all."""
    import socket

    from transformers import CLIPTokenizer

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(M, "_HUB_REACHABLE", {})
    asked = []

    def unreachable(address, timeout):
        asked.append((address, timeout))
        raise OSError("no route to host")

    monkeypatch.setattr(socket, "create_connection", unreachable)
    calls = []

    def from_pretrained(name, **kwargs):
        calls.append(kwargs)
        raise OSError(f"{name} is not in the cache")

    monkeypatch.setattr(CLIPTokenizer, "from_pretrained", from_pretrained)
    with pytest.raises(M.TokenizerError, match="the hub cannot be reached and it is not in the local cache"):
        M.load_tokenizer("openai/clip-vit-large-patch14")
    assert calls[-1]["local_files_only"] is True and asked == [(("huggingface.co", 443), 3.0)]
    assert M.hub_options("openai/clip-vit-large-patch14") == {"local_files_only": True} and len(asked) == 1  # once
    assert M.hub_options(str(tmp_path)) == {} and M.hub_options("./not/a/hub/id") == {}
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")  # only the proxy knows
    assert M.hub_options("openai/clip-vit-large-patch14") == {}


def test_a_pipeline_cast_to_bf16_says_nothing_about_float32_modules_and_casts_everything(capfd):
    """diffusers warned "should be kept in float32: []" on every cast of a model with nothing to keep (its
    logger writes to stderr itself)."""
    pipe = sd.sampling.Pipeline(M.build_unet("tiny"), M.load_vae("tiny"), M.load_text_encoder("tiny"),
                                M.load_tokenizer("tiny"), "epsilon")
    capfd.readouterr()
    pipe.to(torch.device("cpu"), torch.bfloat16)
    assert "kept in float32" not in capfd.readouterr().err
    for part in (pipe.unet, pipe.vae, pipe.text_encoder):
        assert {p.dtype for p in part.parameters()} == {torch.bfloat16}


# CLIP skip, as three tools compute it from the same weights (their formulas written out here).
def a1111_condition(text_encoder, ids, clip_stop_at_last_layers):
    """AUTOMATIC1111 (modules/sd_hijack_clip.py, encode_with_transformers): the hidden state
    ``-CLIP_stop_at_last_layers`` through the final layer norm when above 1, else ``last_hidden_state``."""
    outputs = text_encoder(input_ids=ids, output_hidden_states=True)
    if clip_stop_at_last_layers > 1:
        return text_encoder.final_layer_norm(outputs.hidden_states[-clip_stop_at_last_layers])
    return outputs.last_hidden_state


def sd_scripts_condition(text_encoder, ids, clip_skip):
    """sd-scripts (library/train_util.py, get_hidden_states): ``hidden_states[-clip_skip]`` through the final
    layer norm whenever ``--clip_skip`` is given, 1 included."""
    outputs = text_encoder(ids, output_hidden_states=True, return_dict=True)
    return text_encoder.final_layer_norm(outputs["hidden_states"][-clip_skip])


def comfyui_condition(text_encoder, ids, stop_at_clip_layer):
    """ComfyUI (CLIPSetLastLayer, comfy/sd1_clip.py): layer index ``len(layers) + stop_at_clip_layer`` counted
    from the first layer, the output after it normalised (SD 1.x's ``layer_norm_hidden_state``); -1 is the last."""
    layers = text_encoder.config.num_hidden_layers
    index = layers + stop_at_clip_layer  # the layer after which the intermediate output is taken
    hidden = text_encoder(ids, output_hidden_states=True).hidden_states[index + 1]  # [0] is the embeddings
    return text_encoder.final_layer_norm(hidden)


def test_clip_skip_is_the_condition_automatic1111_comfyui_and_sd_scripts_compute():
    text_encoder = M.load_text_encoder("tiny")
    ids = M.tokenize(M.load_tokenizer("tiny"), ["a red circle", "1girl, solo, long hair"])
    with torch.no_grad():
        for skip in (1, 2):
            ours = M.encode_prompt_ids(M.set_clip_skip(text_encoder, skip), ids)
            for theirs in (a1111_condition(text_encoder, ids, skip), sd_scripts_condition(text_encoder, ids, skip),
                           comfyui_condition(text_encoder, ids, -skip)):
                torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
        assert (M.encode_prompt_ids(M.set_clip_skip(text_encoder, 2), ids)
                - M.encode_prompt_ids(M.set_clip_skip(text_encoder, 1), ids)).abs().max() > 0.1
    for bad in (0, 3, True, 1.5):
        with pytest.raises(ValueError, match="a whole number from 1 .* to 2"):
            M.set_clip_skip(text_encoder, bad)


def test_clip_skip_2_on_a_clip_l_sized_encoder_takes_the_penultimate_layer():
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    text_encoder = CLIPTextModel(CLIPTextConfig(**{**M.SD1_TEXT_ENCODER, "hidden_size": 64, "intermediate_size": 128,
                                                   "num_attention_heads": 4})).eval()  # 12 layers, as CLIP ViT-L
    ids = torch.randint(0, 49408, (2, 77))
    with torch.no_grad():
        ours = M.encode_prompt_ids(M.set_clip_skip(text_encoder, 2), ids)
        torch.testing.assert_close(ours, comfyui_condition(text_encoder, ids, -2), rtol=0, atol=1e-6)
        torch.testing.assert_close(ours, a1111_condition(text_encoder, ids, 2), rtol=0, atol=1e-6)
