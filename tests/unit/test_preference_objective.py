"""The Diffusion-DPO objective (``sd.train.objectives.preference``) against diffusers' research script on the same
inputs: ``examples/research_projects/diffusion_dpo/train_diffusion_dpo.py``'s loss, written out below line for line
as that script computes it (its pixel batch already encoded: preferred latents, then rejected), with the noise and
timesteps our objective drew."""

import pytest
import torch

import sd.lora.adapters
import sd.model
from sd.train.objectives.base import LossContext, LossSettings
from sd.train.objectives.preference import DirectPreference, PreferenceSettings, implicit_accuracy, pair_loss
from sd.train.objectives.lcm import frozen_copy

PAIRS = 3


def diffusers_dpo(unet, reference, latents_w, latents_l, noise_half, timesteps_half, hidden, alphas, beta,
                  loss_type, prediction_type):
    """diffusers' DPO step for SD 1.5, from its latents on: one noise and one timestep per pair, repeated; the
    reference pass with the adapters disabled (PEFT's layers, as ``unet.disable_adapters()`` does), or a frozen
    copy of a whole UNet."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    latents = torch.cat([latents_w, latents_l])
    noise = noise_half.repeat(2, 1, 1, 1)
    timesteps = timesteps_half.repeat(2)
    a = alphas.to(latents.dtype)[timesteps].reshape(-1, 1, 1, 1)  # the scheduler casts them to the samples' type
    noisy_model_input = a.sqrt() * latents + (1 - a).sqrt() * noise  # DDPMScheduler.add_noise
    encoder_hidden_states = hidden.repeat(2, 1, 1)
    model_pred = unet(noisy_model_input, timesteps, encoder_hidden_states).sample
    target = noise if prediction_type == "epsilon" else a.sqrt() * noise - (1 - a).sqrt() * latents  # get_velocity
    model_losses = torch.nn.functional.mse_loss(model_pred.float(), target.float(), reduction="none")
    model_losses = model_losses.mean(dim=list(range(1, len(model_losses.shape))))
    model_losses_w, model_losses_l = model_losses.chunk(2)
    model_diff = model_losses_w - model_losses_l
    layers = [m for m in unet.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    with torch.no_grad():
        ref_preds = (reference or unet)(noisy_model_input, timesteps, encoder_hidden_states).sample.detach()
        ref_loss = torch.nn.functional.mse_loss(ref_preds.float(), target.float(), reduction="none")
        ref_loss = ref_loss.mean(dim=list(range(1, len(ref_loss.shape))))
        ref_losses_w, ref_losses_l = ref_loss.chunk(2)
        ref_diff = ref_losses_w - ref_losses_l
    for layer in layers:
        layer.enable_adapters(True)
    logits = ref_diff - model_diff
    if loss_type == "sigmoid":
        loss = -1 * torch.nn.functional.logsigmoid(beta * logits).mean()
    elif loss_type == "hinge":
        loss = torch.relu(1 - beta * logits).mean()
    else:  # ipo (the script names args.beta there; its beta_dpo is meant)
        loss = ((logits - 1 / (2 * beta)) ** 2).mean()
    implicit_acc = (logits > 0).sum().float() / logits.size(0)
    implicit_acc += 0.5 * (logits == 0).sum().float() / logits.size(0)
    return loss, implicit_acc


def context_for(unet, hidden, prediction_type: str) -> LossContext:
    settings = LossSettings(prediction_type=prediction_type, precision="fp32", cfg_dropout=0.0, min_snr_gamma=0.0)
    return LossContext(torch.device("cpu"), settings, 1.0, sd.model.ddpm_alphas_cumprod(), unet,
                       torch.zeros(1, 77, hidden.shape[-1]), lambda ids, generator: hidden, lambda *a: {})


def trained_lora_unet(kind: str = "lora"):
    """A tiny UNet with an adapter whose weights are not at their start (the model differs from its reference)."""
    unet = sd.model.build_unet("tiny", seed=3, from_scratch=False)
    sd.lora.adapters.add_lora(unet, sd.lora.adapters.resolve_targets(unet, ["attention"]), rank=4, alpha=4.0, kind=kind)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in unet.named_parameters():
            if parameter.requires_grad:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return unet


def draws(seed: int, latents: torch.Tensor):
    """What the objective draws from a generator seeded ``seed``, in its order: one noise and one timestep a pair."""
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(latents.shape, generator=generator)
    return noise, sd.model.sample_timesteps(latents.shape[0], generator)


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo"])
@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_the_dpo_loss_of_a_lora_equals_diffusers_on_the_same_inputs(loss_type, prediction_type):
    unet = trained_lora_unet()
    generator = torch.Generator().manual_seed(0)
    preferred, rejected = torch.randn(PAIRS, 4, 8, 8, generator=generator), torch.randn(PAIRS, 4, 8, 8, generator=generator)
    hidden = torch.randn(PAIRS, 77, unet.config.cross_attention_dim, generator=generator)
    beta = 2500.0 if loss_type != "ipo" else 50.0
    objective = DirectPreference(PreferenceSettings(beta, loss_type))
    context = context_for(unet, hidden, prediction_type)
    ours, timesteps = objective.loss(context, unet, preferred, None, torch.Generator().manual_seed(7), None,
                                     {"rejected": rejected})
    noise, drawn = draws(7, preferred)
    assert torch.equal(timesteps, drawn)
    theirs, accuracy = diffusers_dpo(unet, None, preferred, rejected, noise, drawn, hidden,
                                     context.alphas_cumprod, beta, loss_type, prediction_type)
    torch.testing.assert_close(ours.mean(), theirs, rtol=1e-5, atol=1e-6)
    stats = objective.measured(torch.device("cpu"))
    assert stats[-1] == PAIRS and stats[0] / PAIRS == pytest.approx(accuracy.item())
    assert theirs.item() != pytest.approx(pair_loss(torch.zeros(1), beta, loss_type).item())  # the LoRA matters


def test_the_gradient_is_diffusers_too():
    unet = trained_lora_unet()
    generator = torch.Generator().manual_seed(0)
    preferred, rejected = torch.randn(PAIRS, 4, 8, 8, generator=generator), torch.randn(PAIRS, 4, 8, 8, generator=generator)
    hidden = torch.randn(PAIRS, 77, unet.config.cross_attention_dim, generator=generator)
    trained = [p for p in unet.parameters() if p.requires_grad]
    objective = DirectPreference(PreferenceSettings(2500.0, "sigmoid"))
    ours, _ = objective.loss(context_for(unet, hidden, "epsilon"), unet, preferred, None,
                             torch.Generator().manual_seed(7), None, {"rejected": rejected})
    ours_grads = torch.autograd.grad(ours.mean(), trained)
    noise, drawn = draws(7, preferred)
    theirs, _ = diffusers_dpo(unet, None, preferred, rejected, noise, drawn, hidden, sd.model.ddpm_alphas_cumprod(),
                              2500.0, "sigmoid", "epsilon")
    for a, b in zip(ours_grads, torch.autograd.grad(theirs, trained)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_lycoris_adapters_are_switched_off_for_the_reference(kind):
    unet = trained_lora_unet(kind)
    generator = torch.Generator().manual_seed(0)
    preferred, rejected = torch.randn(2, 4, 8, 8, generator=generator), torch.randn(2, 4, 8, 8, generator=generator)
    hidden = torch.randn(2, 77, unet.config.cross_attention_dim, generator=generator)
    objective = DirectPreference(PreferenceSettings(2500.0, "sigmoid"))
    unet.eval()  # LyCORIS layers apply module dropout only while training; none is set
    with torch.no_grad():
        ours, _ = objective.loss(context_for(unet, hidden, "epsilon"), unet, preferred, None,
                                 torch.Generator().manual_seed(7), None, {"rejected": rejected})
        noise, drawn = draws(7, preferred)
        theirs, _ = diffusers_dpo(unet, None, preferred, rejected, noise, drawn, hidden,
                                  sd.model.ddpm_alphas_cumprod(), 2500.0, "sigmoid", "epsilon")
    torch.testing.assert_close(ours.mean(), theirs, rtol=1e-5, atol=1e-6)


def test_a_whole_unet_against_its_frozen_copy_starts_at_log_2_and_equals_diffusers_once_moved():
    unet = sd.model.build_unet("tiny", seed=3, from_scratch=False)
    reference = frozen_copy(unet, torch.float32)
    objective = DirectPreference(PreferenceSettings(2500.0, "sigmoid"), reference)
    generator = torch.Generator().manual_seed(0)
    preferred, rejected = torch.randn(PAIRS, 4, 8, 8, generator=generator), torch.randn(PAIRS, 4, 8, 8, generator=generator)
    hidden = torch.randn(PAIRS, 77, unet.config.cross_attention_dim, generator=generator)
    context = context_for(unet, hidden, "epsilon")
    start, _ = objective.loss(context, unet, preferred, None, torch.Generator().manual_seed(7), None,
                              {"rejected": rejected})
    torch.testing.assert_close(start, torch.full((PAIRS,), float(torch.log(torch.tensor(2.0)))))
    assert objective.measured(torch.device("cpu"))[0] == 0.5 * PAIRS  # every logit 0: half a pair each
    with torch.no_grad():
        for parameter in unet.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.02)
    moved, _ = objective.loss(context, unet, preferred, None, torch.Generator().manual_seed(7), None,
                              {"rejected": rejected})
    noise, drawn = draws(7, preferred)
    theirs, _ = diffusers_dpo(unet, reference, preferred, rejected, noise, drawn, hidden,
                              sd.model.ddpm_alphas_cumprod(), 2500.0, "sigmoid", "epsilon")
    torch.testing.assert_close(moved.mean(), theirs, rtol=1e-5, atol=1e-6)
    assert moved.mean().item() != pytest.approx(start.mean().item())


def test_both_images_of_a_pair_share_the_noise_and_the_timestep():
    seen = {}

    class Recorder(torch.nn.Module):
        def forward(self, sample, timesteps, encoder_hidden_states=None):
            seen.setdefault("calls", []).append((sample.clone(), timesteps.clone(), encoder_hidden_states.clone()))
            return type("Out", (), {"sample": torch.zeros_like(sample)})()

    recorder = Recorder()
    objective = DirectPreference(PreferenceSettings(), reference=recorder)
    same = torch.randn(PAIRS, 4, 8, 8)
    hidden = torch.randn(PAIRS, 77, 32)
    objective.loss(context_for(recorder, hidden, "epsilon"), recorder, same, None, torch.Generator().manual_seed(3),
                   None, {"rejected": same.clone()})
    (model_in, model_t, model_h), (reference_in, reference_t, _) = seen["calls"]
    assert torch.equal(model_in[:PAIRS], model_in[PAIRS:]) and torch.equal(model_t[:PAIRS], model_t[PAIRS:])
    assert torch.equal(model_h[:PAIRS], model_h[PAIRS:])
    assert torch.equal(model_in, reference_in) and torch.equal(model_t, reference_t)
    assert len(set(model_t[:PAIRS].tolist())) > 1  # a timestep per pair, not one for all


def test_implicit_accuracy_counts_a_tie_half():
    assert implicit_accuracy(torch.tensor([1.0, -1.0, 0.0])).tolist() == [1.0, 0.0, 0.5]
