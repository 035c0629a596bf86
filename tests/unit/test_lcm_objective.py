"""Latent consistency distillation (sd.train.objectives.lcm): the solver's timesteps, the boundary scalings, the
whole loss of a micro-batch against a reference computed by hand, the teacher and the target network."""

import copy
import math
import re

import numpy as np
import pytest
import torch

import sd.lora.adapters
import sd.model
import sd.train.objectives.lcm as distill
import sd.train.step
from sd.distributed import Dist
from sd.train.config import ConfigError, TrainConfig

from fake_cuda import fake_cuda, steady_steps, zero_gradients

FIELDS = dict(unet="tiny", text_encoder="tiny", vae="tiny", precision="fp32", grad_checkpointing=False,
              ema_decay=0.0, datasets=[], distill="lcm", init_from="base", lcm_guidance_min=2.0, lcm_guidance_max=8.0)


def hand_alphas_cumprod() -> np.ndarray:
    """SD's scaled_linear schedule in float64, written out: betas from sqrt(0.00085) to sqrt(0.012), squared."""
    betas = np.linspace(math.sqrt(0.00085), math.sqrt(0.012), 1000) ** 2
    return np.cumprod(1 - betas)


def test_the_solver_skips_twenty_timesteps_of_a_thousand_ending_at_the_last():
    assert distill.solver_timesteps(50).tolist() == [20 * i - 1 for i in range(1, 51)]
    assert distill.solver_timesteps(4).tolist() == [249, 499, 749, 999]


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_x0_and_noise_recover_what_made_x_t(prediction_type):
    alphas = sd.model.ddpm_alphas_cumprod()
    generator = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(3, 4, 8, 8, generator=generator), torch.randn(3, 4, 8, 8, generator=generator)
    t = torch.tensor([19, 500, 999])
    x_t = sd.model.add_noise(x0, noise, t, alphas)
    output = sd.model.prediction_target(x0, noise, t, alphas, prediction_type)
    got_x0, got_noise = distill.x0_and_noise(output, x_t, t, alphas, prediction_type)
    torch.testing.assert_close(got_x0, x0, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(got_noise, noise, atol=2e-4, rtol=1e-4)


def perturbed(module, seed: int, scale: float = 0.05):
    """``module`` with every parameter that trains moved by seeded noise (three networks that differ)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:
                p.add_(scale * torch.randn(p.shape, generator=generator))
    return module


def build(fields=None):
    config = TrainConfig(**{**FIELDS, **(fields or {})})
    unet = sd.model.build_unet("tiny", seed=3, from_scratch=False)
    encoder = sd.model.load_text_encoder("tiny")
    sd.lora.adapters.apply_settings(sd.lora.adapters.LoraSettings.from_config(config), unet, encoder)
    tokenizer = sd.model.load_tokenizer("tiny")
    return sd.train.step.build_step(config, Dist.single(), unet, encoder, sd.model.tokenize(tokenizer, [""]), 0.5), tokenizer


@pytest.mark.parametrize("loss", ["huber", "l2"])
def test_the_loss_of_a_micro_batch_equals_the_hand_computed_one(loss):
    """Teacher, student and target all differ; the reference runs each network on its own (cond and uncond
    separately) and writes every formula out in float64 with the schedule computed by hand."""
    step, tokenizer = build({"lcm_loss": loss, "lcm_huber_c": 0.01})
    teacher = step.objective.teacher
    perturbed(step.unet, 1)  # the student has trained a while ...
    target = perturbed(copy.deepcopy(step.unet), 2)  # ... and the target lags it
    step.objective.target.load_state_dict({n: p.detach().clone() for n, p in target.named_parameters()})

    latents = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(7)).half()
    ids = sd.model.tokenize(tokenizer, ["a red circle", "a blue square", "a star"])
    got, start = distill.lcm_loss(step.objective, sd.train.step.loss_context(step), step.unet, latents, ids,
                                  torch.Generator().manual_seed(11))

    replay = torch.Generator().manual_seed(11)
    x0 = latents.double() * 0.5
    noise = torch.randn(x0.shape, generator=replay).double()
    index = torch.randint(0, 50, (3,), generator=replay)
    scale = 2.0 + 6.0 * torch.rand(3, generator=replay).double()
    abar = hand_alphas_cumprod()
    hidden = sd.model.encode_prompt_ids(step.text_encoder, ids)
    empty = step.empty_embedding
    expected = []
    for i in range(3):
        t_n = 20 * (int(index[i]) + 1) - 1
        t_end = max(t_n - 20, 0)
        a_n, a_end = abar[t_n], abar[t_end]
        x_t = math.sqrt(a_n) * x0[i : i + 1] + math.sqrt(1 - a_n) * noise[i : i + 1]

        def run(net, x, t, h):
            with torch.no_grad():
                return net(x.float(), torch.tensor([t]), encoder_hidden_states=h).sample.double()

        def f(out, x, t, a):  # c_skip x + c_out x0, epsilon prediction
            c_skip, c_out = 0.25 / ((10 * t) ** 2 + 0.25), 10 * t / math.sqrt((10 * t) ** 2 + 0.25)
            return c_skip * x + c_out * (x - math.sqrt(1 - a) * out) / math.sqrt(a)

        student = f(run(step.unet, x_t, t_n, hidden[i : i + 1]), x_t, t_n, a_n)
        cond, uncond = run(teacher, x_t, t_n, hidden[i : i + 1]), run(teacher, x_t, t_n, empty)
        x0_c, x0_u = [(x_t - math.sqrt(1 - a_n) * e) / math.sqrt(a_n) for e in (cond, uncond)]
        s = float(scale[i])
        eps_g, x0_g = uncond + s * (cond - uncond), x0_u + s * (x0_c - x0_u)
        x_end = math.sqrt(a_end) * x0_g + math.sqrt(1 - a_end) * eps_g
        aimed = f(run(target, x_end, t_end, hidden[i : i + 1]), x_end, t_end, a_end)
        diff = student - aimed
        per_element = (diff**2 + 0.01**2).sqrt() - 0.01 if loss == "huber" else diff**2
        expected.append(per_element.mean().item())
        assert start[i] == t_n
    assert got.tolist() == pytest.approx(expected, rel=2e-4, abs=1e-7)


def test_the_lora_teacher_is_the_base_and_the_target_stands_in_for_the_adapters_without_touching_them():
    step, _ = build({"lora_rank": 4, "lora_targets": ["attention", "resnet"]})
    unet = step.unet
    base = sd.model.build_unet("tiny", seed=3, from_scratch=False)
    perturbed(unet, 1, scale=0.5)  # the adapters have trained
    x, t, h = torch.randn(2, 4, 8, 8), torch.tensor([5, 900]), torch.randn(2, 77, 64)
    with torch.no_grad():
        student = unet(x, t, encoder_hidden_states=h).sample
        assert torch.equal(step.objective.teacher_output(unet, x, t, h), base(x, t, encoder_hidden_states=h).sample)
        live = {n: p.detach().clone() for n, p in unet.named_parameters()}
        shadow = [s.clone() for s in step.objective.target.shadow]
        target = step.objective.target_output(unet, x, t, h)
    assert step.objective.target.names and all(sd.lora.adapters.is_adapter_name(n) for n in step.objective.target.names)
    assert not torch.equal(student, target)
    assert all(torch.equal(live[n], p) for n, p in unet.named_parameters())  # the live weights untouched
    assert all(torch.equal(a, b) for a, b in zip(shadow, step.objective.target.shadow))
    assert all(p.requires_grad == sd.lora.adapters.is_adapter_name(n) for n, p in unet.named_parameters())
    with torch.no_grad():  # the target at its start: the adapters as built (B = 0), so the base's output
        torch.testing.assert_close(target, base(x, t, encoder_hidden_states=h).sample, rtol=0, atol=1e-6)


def test_the_target_moves_by_one_minus_its_decay_towards_the_student_at_each_step():
    step, tokenizer = build({"lcm_target_decay": 0.9, "lr": 1e-2, "warmup_steps": 0})
    before = [s.clone() for s in step.objective.target.shadow]
    latents = torch.randn(2, 4, 8, 8).half()
    result = sd.train.step.train_step(step, [(latents, sd.model.tokenize(tokenizer, ["a", "b"]))], 0)
    assert not result["bad"]
    after = step.objective.target.parameters(step.unet)
    for old, new, live in zip(before, step.objective.target.shadow, after):
        torch.testing.assert_close(new, 0.9 * old + 0.1 * live.detach(), rtol=1e-6, atol=1e-6)
    assert any(not torch.equal(old, new) for old, new in zip(before, step.objective.target.shadow))
    assert all(p.requires_grad is False for p in step.objective.teacher.parameters())


@pytest.mark.parametrize("fields, message", [
    (dict(distill="lcn"), "distill.method: lcm"),
    (dict(init_from=""), "set init_from (the teacher"),
    (dict(lcm_guidance_min=8.0, lcm_guidance_max=4.0), "distill.guidance_max (4) is below"),
    (dict(lcm_solver_steps=30), "distill.solver_steps: a divisor of 1000"),
    (dict(lcm_loss="l1"), "distill.loss: huber or l2"),
    (dict(embedding_token="<x>", embedding_init="x"), "textual inversion"),
    (dict(lora_rank=4, lora_text_encoder=True), "a text-encoder adapter"),
    (dict(sharding="zero1"), "sharding: none"),
])
def test_a_bad_distillation_setting_is_refused_by_name(fields, message):
    config = TrainConfig(**{**FIELDS, "init_from": "base", **fields})
    with pytest.raises(ConfigError, match=re.escape(message)):
        distill.LatentConsistency.check(config)
    if fields.get("init_from") != "":  # the same from the whole validation, before any work
        with pytest.raises(ConfigError, match=re.escape(message)):
            config.validate(check_paths=False)


@pytest.mark.slow
@pytest.mark.parametrize("fields", [{}, {"lora_rank": 4}], ids=["whole-unet", "lora"])
def test_a_distillation_step_runs_on_cuda_without_waiting_for_it(fields):
    """Teacher, student and target on the GPU, the guidance scales and solver indices drawn there; the
    host never waits in a step (the fused AdamW and the target network skip on the device)."""
    holder, syncs = {}, []
    cuda = torch.device("cuda", 0)
    config = TrainConfig(**{**FIELDS, "precision": "bf16", "batch_size": 2, **fields})
    with fake_cuda(zero_gradients(holder), syncs):
        unet = holder["unet"] = sd.model.build_unet("tiny").to(cuda).train()
        encoder = sd.model.load_text_encoder("tiny")
        sd.lora.adapters.apply_settings(sd.lora.adapters.LoraSettings.from_config(config), unet, encoder)
        step = sd.train.step.build_step(config, Dist.single(cuda), unet, encoder, torch.full((1, 77), 49407), 0.18)
        batch = [(torch.randn(2, 4, 8, 8).half(), torch.randint(0, 49407, (2, 77)))]
        waited, result = steady_steps(step, batch, syncs)
        sd.train.step.read_results([result])
    assert waited == []
    assert {t.device for t in step.objective.target.shadow} == {cuda}
    if step.objective.teacher is not None:
        assert {(p.device, p.dtype) for p in step.objective.teacher.parameters()} == {(cuda, torch.bfloat16)}
