"""sd.train.memory: the predicted peak of a training step, against measured peaks and exact sizes."""

import contextlib
import json
from pathlib import Path

import pytest
import torch

import sd.lora.adapters
import sd.model
import sd.train.memory
import sd.train.step
from sd.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]


def tiny_config(**fields) -> TrainConfig:
    values = dict(unet="tiny", text_encoder="tiny", vae="tiny", batch_size=4, grad_accum=1, datasets=[])
    return TrainConfig(**{**values, **fields})


def rounded(tensors, block=sd.train.memory.ROUND["cuda"]) -> int:
    return sum(-(-t.numel() * t.element_size() // block) * block for t in tensors)


@pytest.mark.slow
def test_the_breakdown_holds_the_exact_sizes_of_the_weights_and_their_states():
    config = tiny_config(grad_checkpointing=False, ema_decay=0.999)
    estimate = sd.train.memory.estimate(config, batch_size=4, resolution=64)
    unet = sd.model.build_unet("tiny")
    weights = rounded([*unet.parameters(), *unet.buffers()])
    fp32 = rounded(unet.parameters())
    parts = estimate.parts
    assert parts["weights"] == weights and parts["ema"] == fp32  # the EMA: an fp32 copy of every parameter
    assert parts["optimizer_state"] == 2 * fp32 + rounded([torch.zeros(())] * len(list(unet.parameters())))
    assert estimate.allocated == sum(parts.values()) and parts["activations_and_temporaries"] > 0


@pytest.mark.slow
def test_the_post_hoc_emas_are_two_more_fp32_copies_where_the_ema_lives():
    unet = sd.model.build_unet("tiny")
    fp32 = rounded(unet.parameters())
    on = sd.train.memory.estimate(tiny_config(ema_decay=0.999, posthoc_ema_every=100), resolution=64).parts["ema"]
    assert on == 3 * fp32  # the classic EMA and the two power-function profiles
    cpu = tiny_config(ema_decay=0.999, ema_device="cpu", posthoc_ema_every=100)
    assert sd.train.memory.estimate(cpu, resolution=64).parts["ema"] == 0


@pytest.mark.slow
def test_ema_on_the_cpu_and_no_ema_take_the_shadow_off_the_card():
    assert sd.train.memory.estimate(tiny_config(ema_decay=0.999, ema_device="cpu"), resolution=64).parts["ema"] == 0
    assert sd.train.memory.estimate(tiny_config(ema_decay=0.0), resolution=64).parts["ema"] == 0


def test_cuda_autocast_emulation_casts_what_cuda_casts_and_caches_weights_for_the_region():
    conv = torch.nn.Conv2d(4, 8, 3, padding=1)
    norm = torch.nn.GroupNorm(2, 8)
    casts = []
    autocast = sd.train.memory.CudaAutocast()
    autocast.on_cast = casts.append
    x = torch.randn(1, 4, 8, 8)
    with autocast:
        with autocast.region(torch.bfloat16):
            y = conv(x)
            z = norm(y)
            again = conv(x)
        outside = conv(x)
    assert (y.dtype, z.dtype, again.dtype, outside.dtype) == (torch.bfloat16, torch.float32, torch.bfloat16,
                                                              torch.float32)
    assert len(casts) == 2  # weight and bias, cast once for both calls in the region
    assert {c.dtype for c in casts} == {torch.bfloat16}


def test_a_weight_used_without_autograd_in_an_autocast_region_still_gets_its_gradient_there():
    """As torch's autocast: a cast made under no_grad (DoRA's norm of the adapted weight) is not the one
    the region's later, differentiated uses get, in the emulation and on the CPU's real autocast alike."""
    def gradient(region):
        linear = torch.nn.Linear(4, 4)
        with region():
            with torch.no_grad():
                linear(torch.ones(1, 4))
            out = linear(torch.ones(1, 4)).float().sum()
        out.backward()
        return linear.weight.grad

    autocast = sd.train.memory.CudaAutocast()

    @contextlib.contextmanager
    def emulated():
        with autocast, autocast.region(torch.bfloat16):
            yield

    for region in (emulated, lambda: torch.autocast("cpu", dtype=torch.bfloat16)):
        assert gradient(region) is not None and torch.equal(gradient(region), torch.ones(4, 4))


@pytest.mark.slow
def test_the_estimate_is_within_five_percent_of_the_cpu_allocators_measured_peak():
    """A real run on the CPU, its allocator's peak read from the profiler (bench/memory_estimate.py's
    measure), against the estimate of the same run on fake tensors."""
    from bench import memory_estimate

    preset, resolution, batch, checkpointing = "tiny", 64, 8, True  # checkpointing: the recomputation too
    measured = memory_estimate.measure(preset, resolution, batch, checkpointing)["measured_bytes"]
    estimate = sd.train.memory.estimate(memory_estimate.config_for(preset, batch, checkpointing), resolution=resolution,
                                  device="cpu")
    assert measured > 20 << 20
    assert abs(estimate.allocated / measured - 1) <= 0.05, (estimate.allocated, measured)


@pytest.mark.slow
def test_estimate_memory_needs_no_data_and_ends_with_one_json_line(tmp_path, capsys):
    import SD_Train

    config = tmp_path / "phase.yaml"
    config.write_text("unet: tiny\ntext_encoder: tiny\nvae: tiny\nbatch_size: 4\ngrad_accum: 1\nmax_steps: 5\n"
                      "ema_device: cpu\n"  # with the defaults grad_checkpointing: true and precision: bf16
                      f"datasets: [{{dataset: {tmp_path / 'absent'}, latents: {tmp_path / 'absent'}}}]\n")
    # 0.55 GB: the context allowance alone; not even one image fits (the positive search: the tests above)
    assert SD_Train.main(["--config", str(config), "--estimate_memory", "--gpu_memory_gb", "0.55",
                          "--resolution", "64"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    lines = out.strip().splitlines()
    answer = json.loads(lines[-1])
    assert answer["peak_gb"] == pytest.approx(answer["reserved_gb"] + sd.train.memory.CONTEXT_GB, abs=1e-3)
    assert answer["batch_size"] == 4 and answer["max_batch"] == 0 and answer["fits"] is False
    assert any(line.startswith("  peak on the card") for line in lines)
    assert "Not even one image fits within 0.55 GB" in out
    assert not (tmp_path / "absent").exists()
    # Advice: only the savings not already on, least memory first, each with its predicted peak.
    advised = [s["setting"] for s in answer["suggestions"]]
    assert advised and set(advised) <= {"optim.name: adamw8bit", "lora.rank: 16 (a LoRA on init_from's weights)"}
    assert "optim.name: adamw8bit" in advised
    peaks = [s["peak_gb"] for s in answer["suggestions"]]
    assert peaks == sorted(peaks) and all(p > 0 for p in peaks)
    assert "grad_checkpointing: true" not in out and "ema_device: cpu" not in out.split("Not even")[1]
    assert "estimating one training step on fake tensors" in captured.err  # progress before the long work
    assert "estimating with optim.name: adamw8bit" in captured.err
    # A line for each micro-batch tried, as it is estimated: the search's sizes, ending at one image.
    tried = [line.split()[1].rstrip(":") for line in captured.err.splitlines() if line.startswith("  micro-batch")]
    assert tried[:2] == ["4", "8"] and "1" in tried and len(tried) == len(set(tried))


def test_estimate_flags_are_checked_before_any_work(capsys):
    import SD_Train

    assert SD_Train.main(["--estimate_memory", "--gpu_memory_gb", "-3", "--unet", "tiny"]) == 2
    assert "--gpu_memory_gb must be > 0, got -3.0" in capsys.readouterr().err
    assert SD_Train.main(["--estimate_memory", "--resolution", "100", "--unet", "tiny"]) == 2
    assert "--resolution must be a positive multiple of 8, got 100" in capsys.readouterr().err


@pytest.mark.parametrize("answer", [0, 1, 2, 37, 100])
@pytest.mark.parametrize("guess", [1, 8, 36, 37, 38, 90])
def test_the_search_finds_the_last_batch_that_fits_from_any_guess(answer, guess):
    calls = []

    def fits(n):
        calls.append(n)
        return n <= answer

    assert sd.train.memory.largest_that_fits(fits, guess, limit=100) == answer
    assert all(1 <= n <= 100 for n in calls) and len(calls) <= 16


@pytest.mark.parametrize("global_batch, world_size, gpu_gb, answer", [
    (0, 1, 25.77, 14), (96, 1, 25.77, 12), (96, 2, 25.77, 12), (96, 2, 27.4, 16), (7, 2, 25.77, 14)])
def test_max_batch_tries_few_sizes_and_only_those_that_could_be_the_answer(global_batch, world_size, gpu_gb, answer):
    """A peak linear in the batch (as the p1 config's: 23.27 GB at 4, +0.25 GB an image): the line through 4
    and the second size (the batch the report shows anyway) finds the answer with two more estimates at
    most; with global_batch only sizes that make it are tried (none make 7 on 2 GPUs: every size, and the
    caller says why none can be used)."""
    tried = []

    def run(batch):
        tried.append(batch)
        return type("Estimate", (), {"peak_gb": 22.27 + 0.25 * batch})()

    config = TrainConfig(unet="tiny", global_batch=global_batch, batch_size=24 if global_batch else 4)
    batch, estimate = sd.train.memory.max_batch(config, gpu_gb, run=run, world_size=world_size, second=24)
    allowed = [b for b in range(1, 1025) if global_batch % (b * world_size) == 0] if global_batch == 96 else None
    larger = next(b for b in (allowed or range(1, 1025)) if b > batch)
    assert batch == answer and estimate.peak_gb <= gpu_gb < 22.27 + 0.25 * larger
    searched = [b for b in dict.fromkeys(tried) if b not in (4, 24)]
    assert len(searched) <= 2, tried
    if global_batch == 96:
        assert all(96 % (b * world_size) == 0 for b in searched), tried


def test_batch_size_auto_is_read_refused_on_the_cpu_and_kept_by_a_resumed_run(tmp_path):
    from sd.distributed import Dist
    from sd.train.config import AUTO_BATCH, ConfigError
    from sd.train.config_loading import load_config

    config = load_config(["--unet", "tiny", "--batch_size", "auto", "--out_dir", str(tmp_path / "run")],
                         check_paths=False)
    assert config.batch_size == AUTO_BATCH
    with pytest.raises(ConfigError, match="batch_size: auto sizes the batch to a CUDA device's memory"):
        sd.train.memory.auto_batch_size(config, Dist.single("cpu"))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("batch_size: 7\n")  # what the run chose when it started
    assert sd.train.memory.auto_batch_size(config, Dist.single("cpu")) == 7


@pytest.mark.slow
def test_batch_size_auto_takes_the_largest_batch_that_fits_and_one_more_would_not():
    from sd.distributed import Dist

    config = tiny_config(batch_size=0, grad_checkpointing=False, out_dir="/nonexistent/run")
    with sd.train.memory.session(config, resolution=512) as run:
        budget = run(3).peak_gb  # a budget that batch 3 just fits
        batch = sd.train.memory.auto_batch_size(config, Dist.single("cpu"), gpu_memory_gb=budget)
        assert batch >= 3 and run(batch).peak_gb <= budget < run(batch + 1).peak_gb
        assert run(3) is run(3)  # a batch asked again is not stepped again


@pytest.mark.slow  # 11 s: the full suite's
def test_a_text_encoder_of_another_width_or_a_lora_target_of_no_layer_stops_the_estimate_in_one_line(tmp_path,
                                                                                                     capsys):
    import SD_Train
    from transformers import CLIPTextConfig, CLIPTextModel

    folder = tmp_path / "wide_text_encoder"
    CLIPTextModel(CLIPTextConfig(**{**sd.model.TINY_TEXT_ENCODER, "hidden_size": 96})).save_pretrained(folder)
    assert SD_Train.main(["--estimate_memory", "--unet", "tiny", "--vae", "tiny", "--text_encoder", str(folder)]) == 2
    err = capsys.readouterr().err
    assert f"text_encoder {folder} gives 96-wide embeddings, but unet tiny attends to 64-wide ones" in err
    assert "Traceback" not in err
    assert SD_Train.main(["--estimate_memory", "--unet", "tiny", "--vae", "tiny", "--text_encoder", "tiny",
                          "--lora_rank", "4", "--init_from", "owner/base", "--lora_targets", "[to_nowhere]"]) == 2
    err = capsys.readouterr().err
    assert "config error: lora.targets: 'to_nowhere' selects no Linear or Conv2d layer" in err
    assert "Traceback" not in err


@pytest.mark.slow
def test_a_learned_token_keeps_optimizer_and_ema_state_for_its_rows_alone():
    config = tiny_config(grad_checkpointing=False, ema_decay=0.999, precision="bf16", embedding_token="<t>",
                         embedding_init="dog", embedding_vectors=3, init_from="owner/base")
    estimate = sd.train.memory.estimate(config, batch_size=4, resolution=64)
    rows = rounded([torch.zeros(3, sd.model.TINY_TEXT_ENCODER["hidden_size"])])
    parts = estimate.parts
    assert parts["optimizer_state"] == 2 * rows + rounded([torch.zeros(())]) and parts["ema"] == rows
    unet = sd.model.build_unet("tiny")
    assert parts["weights"] >= rounded([p.to(torch.bfloat16) for p in unet.parameters()])  # the frozen UNet at bf16
    assert parts["weights"] < rounded([*unet.parameters()])
    assert parts["activations_and_temporaries"] > 0  # the loss reaches the token through the UNet and the encoder


def measured_optimizer_state(config) -> tuple[int, int]:
    """``(bytes, parameters)``: the optimizer state a real step of ``config`` keeps on the CPU, each tensor
    rounded as the estimate rounds CUDA blocks, and how many parameters train. The weights are given
    values that are all non-zero (as trained ones are) where an initialisation leaves a tensor zero,
    except the LoRA up matrices, zero at every LoRA run's start."""
    from sd.distributed import Dist

    text_encoder, _ = sd.train.memory.frozen_models(config)
    unet = sd.model.build_unet(config.unet, from_scratch=False, seed=0)
    with torch.no_grad():
        for p in unet.parameters():
            if not p.any():
                p.normal_()
    sd.lora.adapters.apply_settings(sd.lora.adapters.LoraSettings.from_config(config), unet, text_encoder)
    ids = torch.full((1, sd.model.TOKENIZER_MAX_LENGTH), 49407, dtype=torch.long)
    step = sd.train.step.build_step(config, Dist.single("cpu"), unet, text_encoder, ids, 1.0)
    batch = [(torch.randn(2, 4, 8, 8).half(), torch.full((2, sd.model.TOKENIZER_MAX_LENGTH), 49407))]
    sd.train.step.train_step(step, batch, 0)
    tensors = [t for state in step.optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    return rounded(tensors), sum(p.numel() for p in step.trainable)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer, lr, lora, per_parameter", [
    ("prodigy", 1.0, False, 16),  # exp_avg, exp_avg_sq, s and p0 (its copy of the start): 4 fp32 tensors
    ("prodigy", 1.0, True, None),  # p0 of a LoRA up matrix, zero at the start, is one number
    ("adamw_schedulefree", 1e-3, False, 8),  # z and exp_avg_sq
    ("adamw_schedulefree", 1e-3, True, 8),
])
def test_the_estimated_optimizer_state_is_what_a_real_step_keeps(optimizer, lr, lora, per_parameter):
    lora_fields = dict(lora_rank=4, lora_text_encoder=True, lora_targets=["attention", "resnet"]) if lora else {}
    config = tiny_config(grad_checkpointing=False, ema_decay=0.0, optimizer=optimizer, lr=lr, **lora_fields)
    estimate = sd.train.memory.estimate(config, batch_size=2, resolution=64)
    measured, parameters = measured_optimizer_state(config)
    assert estimate.parts["optimizer_state"] == measured
    if per_parameter is not None:  # to the 512-byte blocks: a block's worth per tensor at most
        assert per_parameter * parameters <= measured <= per_parameter * parameters + 512 * 4 * 1000
    else:
        assert 12 * parameters < measured < 16 * parameters


@pytest.mark.slow  # over 7 s on a 2-core CPU: out of make check
def test_text_adapter_ema_is_counted_with_the_unets():
    config = tiny_config(grad_checkpointing=False, ema_decay=0.9, lora_rank=4, lora_text_encoder=True)
    parts = sd.train.memory.estimate(config, batch_size=1, resolution=32).parts
    unet, text_encoder = sd.model.build_unet("tiny", from_scratch=False), sd.model.load_text_encoder("tiny")
    sd.lora.adapters.apply_settings(sd.lora.adapters.LoraSettings.from_config(config), unet, text_encoder)
    adapters = [p for m in (unet, text_encoder) for p in m.parameters() if p.requires_grad]
    assert parts["ema"] == rounded(adapters)


@pytest.mark.slow
def test_a_controlnet_run_keeps_gradients_optimizer_state_and_ema_for_the_controlnet_alone():
    import sd.controlnet.model

    config = tiny_config(grad_checkpointing=False, ema_decay=0.999, control="canny", init_from="base", precision="bf16")
    estimate = sd.train.memory.estimate(config, batch_size=2, resolution=64)
    unet = sd.model.build_unet("tiny")
    controlnet = list(sd.controlnet.model.new_controlnet(unet).parameters())
    base_bf16 = [p.to(torch.bfloat16) for p in unet.parameters()]  # the frozen base, stored in the autocast type
    parts = estimate.parts
    assert parts["weights"] == rounded([*base_bf16, *unet.buffers(), *controlnet])
    # the ControlNet runs first, so its gradients come last in the backward pass: at its peak some may not exist yet
    assert parts["gradients"] <= rounded(controlnet) and parts["ema"] == rounded(controlnet)
    assert parts["optimizer_state"] == 2 * rounded(controlnet) + rounded([torch.zeros(())] * len(controlnet))


@pytest.mark.slow
@pytest.mark.parametrize("kind,dora", [("loha", False), ("lokr", False), ("loha", True), ("lora", True)])
def test_a_loha_lokr_or_dora_run_keeps_gradients_and_optimizer_state_for_its_factors_alone(kind, dora):
    """The adapter takes part in the estimated step (PEFT's LoHa / LoKr layers apply it behind a host read that
    fake tensors answer with zero: sd.train.memory.adapters_always_on); its AdamW moments and EMA are the
    exact sizes of its factors and DoRA's magnitudes (AdamW's state exists only for parameters that had a
    gradient)."""
    config = tiny_config(lora_rank=4, lora_type=kind, init_from="x", ema_decay=0.9, grad_checkpointing=False,
                         lora_targets=["attention", "resnet"], dora=dora)
    estimate = sd.train.memory.estimate(config, batch_size=2, resolution=64)
    unet = sd.model.build_unet("tiny")
    sd.lora.adapters.apply_settings(sd.lora.adapters.LoraSettings.from_config(config), unet,
                                    sd.model.load_text_encoder("tiny"))
    factors = [p for p in unet.parameters() if p.requires_grad]
    assert factors and estimate.parts["ema"] == rounded(factors)
    assert any(".dora_scale." in name for name, p in unet.named_parameters() if p.requires_grad) == dora
    assert estimate.parts["optimizer_state"] == 2 * rounded(factors) + rounded([torch.zeros(())] * len(factors))


@pytest.mark.slow
def test_a_pivotal_run_keeps_optimizer_state_for_its_adapters_and_its_token():
    """A LoRA and a learned token together (sd.train.modes.Together): AdamW's moments are the exact sizes of the
    UNet's and text encoder's adapters and of the token's rows (fp32), nothing of the frozen base."""
    config = tiny_config(lora_rank=4, lora_text_encoder=True, init_from="x", embedding_token="<x>",
                         embedding_init="dog", embedding_vectors=3, grad_checkpointing=False)
    estimate = sd.train.memory.estimate(config, batch_size=2, resolution=64)
    unet, encoder = sd.model.build_unet("tiny"), sd.model.load_text_encoder("tiny")
    sd.lora.adapters.apply_settings(sd.lora.adapters.LoraSettings.from_config(config), unet, encoder)
    trained = [p for model in (unet, encoder) for p in model.parameters() if p.requires_grad]
    trained.append(torch.zeros(3, encoder.config.hidden_size))  # the token's rows
    assert estimate.parts["optimizer_state"] == 2 * rounded(trained) + rounded([torch.zeros(())] * len(trained))
