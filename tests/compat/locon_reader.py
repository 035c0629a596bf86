"""Whether a diffusers version applies our kohya LoCon files as we do (outside the suite: it needs another
diffusers than the project's; run by ``tests/compat/diffusers_0_32.sh``).

    python tests/compat/locon_reader.py write DIR   # in the project's environment
    python tests/compat/locon_reader.py read DIR    # in the environment of the diffusers under test

``write``: a tiny base pipeline, a LoCon on it (3x3 convolutions at rank 2 / alpha 1, the other layers at
rank 4 / alpha 8) saved as the kohya file ``save_lora`` writes and as one with each alpha as trained, and
the adapted UNet's output on a fixed input. ``read``: each file through that diffusers'
``load_lora_weights``; prints the largest difference from our output and exits 1 when the written file's
is above 1e-5.
"""

import sys
from pathlib import Path

import torch


def write(folder: Path) -> None:
    import copy

    import sd.formats
    import sd.lora.adapters
    import sd.lora.formats
    import sd.model

    unet = sd.model.build_unet("tiny", seed=0, from_scratch=False)
    base, encoder = copy.deepcopy(unet), sd.model.load_text_encoder("tiny")
    sd.formats.export_diffusers(folder / "base", base, sd.model.load_vae("tiny"), encoder, sd.model.load_tokenizer("tiny"))
    sd.lora.adapters.add_lora(unet, sd.lora.adapters.resolve_targets(unet, ["attention", "resnet"]), 4, 8.0,
                              conv_rank=2, conv_alpha=1.0)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in unet.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    lora = {"unet": sd.lora.formats.adapter_lora_modules(unet)}
    sd.lora.formats.save_lora(folder / "written.safetensors", lora)
    folded = sd.lora.formats.fold_alpha
    sd.lora.formats.fold_alpha = lambda adapter: adapter  # each alpha as trained
    try:
        sd.lora.formats.save_lora(folder / "as_trained.safetensors", lora)
    finally:
        sd.lora.formats.fold_alpha = folded
    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    context = torch.randn(1, 77, encoder.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.save({"x": x, "context": context, "ours": unet(x, 10, context).sample, "base": base(x, 10, context).sample},
                   folder / "io.pt")


def read(folder: Path) -> int:
    import diffusers
    from diffusers import StableDiffusionPipeline

    io = torch.load(folder / "io.pt", weights_only=True)
    worst = {}
    for name in ("as_trained", "written"):
        pipe = StableDiffusionPipeline.from_pretrained(str(folder / "base"), safety_checker=None,
                                                       requires_safety_checker=False)
        pipe.load_lora_weights(str(folder / f"{name}.safetensors"))
        with torch.no_grad():
            theirs = pipe.unet(io["x"], 10, io["context"]).sample
        worst[name] = (io["ours"] - theirs).abs().max().item()
        print(f"diffusers {diffusers.__version__}, {name}.safetensors: largest difference from ours {worst[name]:.2e} "
              f"(the adapter moves the output by {(io['ours'] - io['base']).abs().max().item():.2e})")
    return 0 if worst["written"] <= 1e-5 else 1


if __name__ == "__main__":
    command, folder = sys.argv[1], Path(sys.argv[2])
    folder.mkdir(parents=True, exist_ok=True)
    sys.exit(write(folder) or 0 if command == "write" else read(folder))
