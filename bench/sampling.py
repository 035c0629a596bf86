"""Benchmark: DDIM sampling iterations/s of SD_ImageGen vs diffusers' StableDiffusionPipeline.

    python bench/sampling.py                                   # CPU: tiny UNet, 64 px, eager
    python bench/sampling.py --arch sd1 --resolution 512 --modes eager,default,reduce-overhead   # GPU

Both denoise the same noise with the same random-weight UNet, the same prompt and negative-prompt
embeddings (text encoding is outside the timing), 50 DDIM steps and guidance 7.5, and stop at the
latents (no VAE decode):
* ours: ``sd.sampling.sample_latents`` with DDIM, what ``SD_ImageGen.py`` runs;
* peer: ``StableDiffusionPipeline`` with a ``DDIMScheduler`` of the same schedule and
  ``output_type="latent"``.
Each mode is ``eager`` or a ``torch.compile`` mode applied to both UNets (``default``,
``reduce-overhead`` = CUDA graphs, ``max-autotune``), the way ``SD_ImageGen.py --compile MODE`` does.
An iteration is one denoising step (one UNet call on 2 x batch for guidance). Prints iterations/s,
the ratio ours/peer, how far apart the two results are, and one JSON line.
"""

from __future__ import annotations

import statistics

import torch

import sd.model
import sd.runtime
import sd.sampling
from bench import harness

MODES = ("eager",) + sd.sampling.COMPILE_MODES[1:]


def build(arch: str, device, dtype):
    """Our Model (random weights) and a diffusers pipeline sharing its UNet, VAE and text encoder."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    unet = sd.model.build_unet(harness.unet_preset(arch), seed=0, from_scratch=False).eval()
    vae, text_encoder = harness.random_vae(arch), harness.random_text_encoder(arch)
    for part in (unet, vae, text_encoder):
        part.to(device=device, dtype=dtype)
    model = sd.sampling.Pipeline(unet, vae, text_encoder, None, "epsilon", f"random {arch}")
    pipeline = StableDiffusionPipeline(
        unet=unet, vae=vae, text_encoder=text_encoder, tokenizer=None,
        scheduler=sd.model.build_noise_scheduler("epsilon", DDIMScheduler),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipeline.set_progress_bar_config(disable=True)
    return model, pipeline


def prompt_embeddings(text_encoder, batch: int):
    """A prompt and the empty negative prompt, encoded once: ``(B, 77, D)`` each."""
    _, ids = harness.synthetic_batch(1, 1)
    cond = sd.model.encode_prompt_ids(text_encoder, ids)
    uncond = sd.model.encode_prompt_ids(text_encoder, harness.empty_prompt_ids())
    return cond.expand(batch, -1, -1), uncond.expand(batch, -1, -1)


def run_ours(model, unet, noise, cond, uncond, steps: int, cfg: float):
    model.unet = unet
    with torch.no_grad(), sd.model.attention_context(noise.device):
        return sd.sampling.sample_latents(model.unet, noise, cond, uncond, sampler="ddim", steps=steps, cfg=cfg,
                                          prediction_type=model.prediction_type)


def run_peer(pipeline, unet, noise, cond, uncond, steps: int, cfg: float):
    pipeline.unet = unet
    size = noise.shape[-1] * pipeline.vae_scale_factor
    with torch.no_grad():
        return pipeline(prompt_embeds=cond, negative_prompt_embeds=uncond, latents=noise.to(cond.dtype),
                        num_inference_steps=steps, guidance_scale=cfg, height=size, width=size,
                        output_type="latent").images


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--batch_sizes", default="1,8", help="images per sampling call")
    parser.add_argument("--modes", default="eager,default" if cuda else "eager",
                        help=f"comma-separated, from {', '.join(MODES)}")
    parser.add_argument("--steps", type=int, default=50, help="DDIM steps")
    parser.add_argument("--cfg", type=float, default=7.5, help="guidance scale")
    parser.add_argument("--repeats", type=int, default=5 if cuda else 3,
                        help="timed sampling calls per measurement, alternating ours and the peer; the median counts")
    parser.add_argument("--precision", choices=["auto", "bf16", "fp16", "fp32"], default="auto",
                        help="auto: bf16 on a GPU, fp32 on a CPU (as SD_ImageGen.py)")
    parser.add_alias("--dtype", "precision", choices=["auto", "bf16", "fp16", "fp32"])
    args = parser.parse_args(argv)
    unknown = set(harness.parse_list(args.modes, str)) - set(MODES)
    if unknown:
        parser.error(f"--modes: unknown {sorted(unknown)}; choose from {', '.join(MODES)}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = sd.runtime.pick_device(args.device)
    dtype = sd.runtime.resolve_precision(args.precision, device)
    model, pipeline = build(args.arch, device, dtype)
    base_unet = model.unet
    latent_size = args.resolution // harness.vae_factor(args.arch)
    print(f"{args.arch} UNet, {args.resolution} px, {args.steps} DDIM steps, guidance {args.cfg}, "
          f"{str(dtype).replace('torch.', '')}, {harness.device_name(device)}")
    rows, compared = [], []
    for mode in harness.parse_list(args.modes, str):
        for batch in harness.parse_list(args.batch_sizes):
            # Compiled afresh for each batch size, as SD_ImageGen.py runs one: static shapes, no
            # dynamic-shape recompile. Both share the module; each call signature gets its own graph.
            harness.release(device)
            unet = sd.sampling.compile_unet(base_unet, "off" if mode == "eager" else mode)
            noise = sd.sampling.initial_noise(list(range(batch)), (4, latent_size, latent_size)).to(device)
            cond, uncond = prompt_embeddings(model.text_encoder, batch)
            results = {}
            calls = {"ours": lambda: results.__setitem__("ours", run_ours(model, unet, noise, cond, uncond,
                                                                          args.steps, args.cfg)),
                     "peer": lambda: results.__setitem__("peer", run_peer(pipeline, unet, noise, cond, uncond,
                                                                          args.steps, args.cfg))}
            # Warm both (compiling), then alternate single timed calls so drift hits both alike.
            seconds = {impl: [] for impl in calls}
            for repeat in range(args.repeats + 1):
                for impl, call in calls.items():
                    elapsed = harness.time_steps(call, device, warmup=0, steps=1)
                    if repeat:
                        seconds[impl].append(elapsed)
            rates = {impl: args.steps / statistics.median(times) for impl, times in seconds.items()}
            for impl, rate in rates.items():
                rows.append({"impl": impl, "mode": mode, "batch": batch, "it_per_s": rate,
                             "images_per_s": batch * rate / args.steps})
            difference = (results["ours"].float() - results["peer"].float()).abs().max().item()
            compared.append({"mode": mode, "batch": batch, "ratio": round(rates["ours"] / rates["peer"], 3),
                             "max_abs_difference": difference})

    harness.print_table(rows, lambda row: f"{row['impl']} {row['mode']}",
                        [("batch", "batch", "d"), ("it_per_s", "it/s", ".2f"), ("images_per_s", "images/s", ".3f")])
    for c in compared:
        print(f"ratio ours/peer {c['mode']} at batch {c['batch']} = {c['ratio']:.2f}x "
              f"(latents differ by at most {c['max_abs_difference']:.2e})")
    result = {"benchmark": "sampling", "device": harness.device_name(device), "arch": args.arch,
              "resolution": args.resolution, "steps": args.steps, "dtype": str(dtype).replace("torch.", ""),
              "torch": torch.__version__, "rows": rows, "ratios": compared}
    harness.emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
