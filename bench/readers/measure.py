"""Which outside readers load which of our files, measured on tiny random models (CPU, offline).

    python bench/readers/measure.py                 # write, then read here and with $READERS_PYTHON
    python bench/readers/measure.py write DIR       # project venv: every file kind, with our own code
    python bench/readers/measure.py read DIR        # any venv: the readers importable there

``write`` (needs ``sd``): a tiny base pipeline folder, single files fp32 / fp16, LoRA files of each kind
(kohya LoRA, diffusers LoRA, LoCon, LoHa, LoKr, DoRA, pivotal LoRA with ``bundle_emb``), an AUTOMATIC1111
embedding and a ControlNet (folder and single file), each beside the weights it must give (``ref/``: the
adapted model merged by PEFT, the embedding's vectors, the ControlNet's state).
``read`` (never imports ``sd``): each file through the readers this environment has, diffusers
(``load_lora_weights`` + ``fuse_lora``, ``from_single_file``, ``from_pretrained``, ``load_textual_inversion``),
LyCORIS (``lycoris.kohya.create_network_from_weights`` + ``merge_to``) and sd-scripts (``networks.lora``
``create_network_from_weights`` + ``merge_to``, ``networks/check_lora_weights.py``; ``$SD_SCRIPTS`` a
checkout). One line per (kind, reader): loads, equal / loads, differs (what) / refuses (message).
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import torch

LORA_KINDS = ("lora_kohya", "lora_diffusers", "locon", "loha", "lokr", "dora", "pivotal")
TOKEN = "sks"
ATOL, RTOL = 1e-5, 1e-4


# ------------------------------------------------------------------------------------------------ write


def write(folder: Path) -> None:
    from safetensors.torch import save_file

    import sd.controlnet.formats as cnf
    import sd.embedding.formats
    import sd.formats
    import sd.lora.adapters as adapters
    import sd.lora.formats
    import sd.model

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ref").mkdir(exist_ok=True)
    unet = sd.model.build_unet("tiny", seed=0, from_scratch=False).eval()
    encoder, vae, tokenizer = (sd.model.load_text_encoder("tiny"), sd.model.load_vae("tiny"),
                               sd.model.load_tokenizer("tiny"))

    def ref(name, model_or_state):
        state = model_or_state if isinstance(model_or_state, dict) else model_or_state.state_dict()
        save_file({k: v.detach().float().contiguous() for k, v in state.items()}, str(folder / "ref" / f"{name}.safetensors"))

    sd.formats.export_diffusers(folder / "base", unet, vae, encoder, tokenizer)
    for part, model in (("unet", unet), ("text_encoder", encoder), ("vae", vae)):
        ref(f"base.{part}", model)
    sd.formats.save_single_file(folder / "single_fp32.safetensors", unet, vae, encoder)
    sd.formats.save_single_file(folder / "single_fp16.safetensors", unet, vae, encoder, half=True)

    @torch.no_grad()
    def randomize(model, seed, dora=False):
        generator = torch.Generator().manual_seed(seed)
        for name, param in adapters.adapter_state(model).items():
            if ".dora_scale." in name:  # magnitudes 0.8-1.2 times their start
                param.mul_(0.8 + 0.4 * torch.rand(param.shape, generator=generator))
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)

    for seed, kind in enumerate(LORA_KINDS, 1):
        u, e = copy.deepcopy(unet), copy.deepcopy(encoder)
        lycoris = kind in ("loha", "lokr", "dora")
        convs = kind in ("locon", "loha", "lokr", "dora")
        targets = adapters.resolve_targets(u, ["attention", "resnet"] if convs else ["attention"])
        adapters.add_lora(u, targets, 4, 8.0, conv_rank=2 if convs else 0, conv_alpha=1.0 if convs else 0.0,
                          kind=kind if kind in ("loha", "lokr") else "lora", dora=kind == "dora")
        randomize(u, seed)
        text = not lycoris  # LoHa / LoKr / DoRA: the UNet only
        if text:
            adapters.add_lora(e, adapters.resolve_targets(e, adapters.TEXT_TARGETS), 4, 8.0)
            randomize(e, seed + 100)
        embeddings = None
        if kind == "pivotal":
            width = encoder.get_input_embeddings().weight.shape[1]
            embeddings = {TOKEN: torch.randn(2, width, generator=torch.Generator().manual_seed(7))}
            ref("pivotal.embedding", {"vectors": embeddings[TOKEN]})
        fmt = "diffusers" if kind == "lora_diffusers" else "kohya"
        out = folder / (kind if fmt == "diffusers" else f"{kind}.safetensors")
        sd.lora.formats.save_model_lora(out, u.eval(), e.eval() if text else None, fmt, embeddings=embeddings)
        ref(f"{kind}.unet", adapters.merge(u))
        ref(f"{kind}.text_encoder", adapters.merge(e) if text else encoder)

    vectors = torch.randn(2, encoder.get_input_embeddings().weight.shape[1], generator=torch.Generator().manual_seed(8))
    path = sd.embedding.formats.write_embedding(folder / "ti", TOKEN, vectors, "a1111")
    ref("ti.embedding", {"vectors": vectors})
    (folder / "ti.path").write_text(str(path.relative_to(folder)))

    from diffusers import ControlNetModel

    controlnet = ControlNetModel.from_unet(unet)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in controlnet.named_parameters():
            if name.startswith(("controlnet_down_blocks.", "controlnet_mid_block.", "controlnet_cond_embedding.conv_out.")):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    cnf.save_diffusers(controlnet, folder / "controlnet")
    cnf.save_single_file(controlnet, folder / "controlnet.safetensors")  # fp16, the default
    ref("controlnet", controlnet)


# ------------------------------------------------------------------------------------------------ read


def refs(folder: Path, name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {norm(k): v for k, v in load_file(str(folder / "ref" / f"{name}.safetensors")).items()}


def norm(key: str) -> str:
    """transformers 4's CLIPTextModel names start with text_model., 5's do not."""
    return key.removeprefix("text_model.")


def compare(label: str, model, want: dict, base: dict | None = None, half: bool = False) -> list[str]:
    """What differs between ``model``'s weights and ``want``: [] when equal; else short notes, naming the
    tensors that kept their ``base`` value where ``want`` changed them (a part not applied)."""
    state = {norm(k): v.detach().float() for k, v in model.state_dict().items()}
    missing = sorted(set(want) - set(state))
    if missing:
        return [f"{label}: {len(missing)} tensors absent, e.g. {missing[0]}"]
    differ, unapplied, worst = [], [], 0.0
    for key, expected in want.items():
        expected = expected.half().float() if half else expected
        diff = (state[key] - expected).abs().max().item()
        if diff > ATOL + RTOL * expected.abs().max().item():
            differ.append(key)
            worst = max(worst, diff)
            if base is not None and torch.equal(state[key], base[key]):
                unapplied.append(key)
    if not differ:
        return []
    notes = [f"{label}: {len(differ)} of {len(want)} tensors differ (max {worst:.2g})"]
    if unapplied:
        notes.append(f"{len(unapplied)} of them left at the base, e.g. {unapplied[0]}")
    return notes


class Capture(logging.Handler):
    """Warnings (logging and ``warnings``) raised while a reader runs, first lines, deduplicated."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.add(record.getMessage())

    def add(self, message):
        line = " ".join(str(message).split())[:200]
        if line and line not in self.lines:
            self.lines.append(line)


@contextlib.contextmanager
def captured():
    capture = Capture()
    loggers = [logging.getLogger(name) for name in ("", "diffusers", "transformers", "peft", "lycoris", "networks")]
    for logger in loggers:
        logger.addHandler(capture)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield capture
        finally:
            for logger in loggers:
                logger.removeHandler(capture)
            for w in caught:
                capture.add(w.message)


def outcome(run) -> str:
    """``run()`` returns a list of notes ([]: equal); an exception is a refusal."""
    with captured() as capture:
        try:
            notes = run()
        except Exception as error:  # the reader refuses: its message
            return f"REFUSES {type(error).__name__}: {' '.join(str(error).split())[:260]}"
    said = [w for w in capture.lines if "deprecat" not in w.lower() and "FutureWarning" not in w][:3]
    text = "LOADS, EQUAL" if not notes else "LOADS, DIFFERS: " + "; ".join(notes)
    return text + (f"  [warns: {' | '.join(said)}]" if said else "")


def read(folder: Path) -> None:
    logging.basicConfig(level=logging.ERROR)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import diffusers

    readers = [(f"diffusers {diffusers.__version__}", diffusers_rows)]
    try:
        import lycoris

        from importlib.metadata import version

        readers.append((f"LyCORIS {version('lycoris-lora')} (lycoris.kohya)", lycoris_rows))
    except ImportError:
        pass
    if os.environ.get("SD_SCRIPTS"):
        readers.append(("sd-scripts networks.lora", sd_scripts_rows))
    for name, rows in readers:
        for kind, result in rows(folder):
            print(f"{kind:<22} | {name:<32} | {result}", flush=True)


def base_models(folder: Path):
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel

    base = folder / "base"
    return (UNet2DConditionModel.from_pretrained(str(base / "unet")).eval(),
            CLIPTextModel.from_pretrained(str(base / "text_encoder")).eval(),
            AutoencoderKL.from_pretrained(str(base / "vae")).eval())


def lora_file(folder: Path, kind: str) -> Path:
    return folder / kind / "pytorch_lora_weights.safetensors" if kind == "lora_diffusers" else folder / f"{kind}.safetensors"


def lora_notes(folder, kind, unet, encoder) -> list[str]:
    base_u, base_e = refs(folder, "base.unet"), refs(folder, "base.text_encoder")
    return (compare("unet", unet, refs(folder, f"{kind}.unet"), base_u)
            + compare("text encoder", encoder, refs(folder, f"{kind}.text_encoder"), base_e))


def diffusers_rows(folder: Path):
    from diffusers import ControlNetModel, StableDiffusionPipeline

    def pipeline():
        return StableDiffusionPipeline.from_pretrained(str(folder / "base"), safety_checker=None,
                                                       requires_safety_checker=False, local_files_only=True)

    def pipeline_equal(pipe, half=False):
        return sum((compare(part, getattr(pipe, part), refs(folder, f"base.{part}"), half=half)
                    for part in ("unet", "text_encoder", "vae")), [])

    yield "pipeline folder", outcome(lambda: pipeline_equal(pipeline()))
    for precision in ("fp32", "fp16"):
        yield f"single file {precision}", outcome(lambda: pipeline_equal(StableDiffusionPipeline.from_single_file(
            str(folder / f"single_{precision}.safetensors"), config=str(folder / "base"), local_files_only=True,
            safety_checker=None, requires_safety_checker=False), half=precision == "fp16"))

    for kind in LORA_KINDS:
        def run(kind=kind):
            pipe = pipeline()
            path = lora_file(folder, kind)
            pipe.load_lora_weights(str(path.parent), weight_name=path.name)  # offline: 0.32 wants the name
            pipe.fuse_lora(lora_scale=1.0)
            pipe.unload_lora_weights()
            notes = lora_notes(folder, kind, pipe.unet, pipe.text_encoder)
            if kind == "pivotal" and TOKEN not in pipe.tokenizer.get_vocab():
                notes.append(f"bundle_emb token {TOKEN!r} not added")
            return notes
        yield kind, outcome(run)

    def embedding(token):
        pipe = pipeline()
        pipe.load_textual_inversion(str(folder / (folder / "ti.path").read_text()), token=token)
        ids = pipe.tokenizer.convert_tokens_to_ids([TOKEN, f"{TOKEN}_1"])
        rows = pipe.text_encoder.get_input_embeddings().weight[ids].detach()
        want = refs(folder, "ti.embedding")["vectors"]
        added = [t for t in pipe.tokenizer.get_added_vocab() if t not in ("<|startoftext|>", "<|endoftext|>")]
        if TOKEN not in added:
            return [f"token added as {added[:2]}, not {TOKEN!r}"]
        return [] if torch.allclose(rows, want, atol=1e-6) else [f"vectors differ (max {(rows - want).abs().max():.2g})"]

    yield "embedding token=sks", outcome(lambda: embedding(TOKEN))
    yield "embedding no token", outcome(lambda: embedding(None))
    want = refs(folder, "controlnet")
    yield "controlnet folder", outcome(lambda: compare("controlnet", ControlNetModel.from_pretrained(
        str(folder / "controlnet")), want))
    yield "controlnet single fp16", outcome(lambda: compare("controlnet", ControlNetModel.from_single_file(
        str(folder / "controlnet.safetensors"), config=str(folder / "controlnet"), local_files_only=True), want, half=True))


def lycoris_rows(folder: Path):
    from lycoris.kohya import LycorisNetworkKohya, create_network_from_weights

    targets = list(LycorisNetworkKohya.UNET_TARGET_REPLACE_MODULE)
    for kind in LORA_KINDS:
        def run(kind=kind):
            unet, encoder, vae = base_models(folder)
            network, weights = create_network_from_weights(1.0, str(lora_file(folder, kind)), vae, encoder, unet)
            loaded = len(network.unet_loras) + len(network.text_encoder_loras)
            network.merge_to(encoder, unet, weights, torch.float32, "cpu")
            notes = lora_notes(folder, kind, unet, encoder)
            return notes + ([f"{loaded} modules built"] if notes else [])
        result = outcome(run)
        yield kind, result
        if "duplicated lora name" in result and "TimestepEmbedding" in targets:
            # 4.x lists the class TimestepEmbedding (Anima) beside the names time_embedding.linear_1/_2: an SD 1.x
            # UNet's layers are then made twice. Again without that class, to see what the loader itself does:
            LycorisNetworkKohya.UNET_TARGET_REPLACE_MODULE = [t for t in targets if t != "TimestepEmbedding"]
            yield f"{kind} (w/o TimestepEmb.)", outcome(run)
            LycorisNetworkKohya.UNET_TARGET_REPLACE_MODULE = targets


def sd_scripts_rows(folder: Path):
    """sd-scripts' loader; its checkout ($SD_SCRIPTS) is on this process's PYTHONPATH (``main`` sets it)."""
    try:
        import torchvision  # noqa: F401
    except ImportError:  # library/utils.py imports torchvision.transforms for image helpers the loader never calls
        import types

        stub = types.ModuleType("torchvision")
        stub.transforms = types.ModuleType("torchvision.transforms")
        sys.modules.update({"torchvision": stub, "torchvision.transforms": stub.transforms})
    import networks.check_lora_weights as check
    import networks.lora as kohya_lora

    for kind in LORA_KINDS:
        def run(kind=kind):
            unet, encoder, vae = base_models(folder)
            network, weights = kohya_lora.create_network_from_weights(1.0, str(lora_file(folder, kind)), vae, encoder, unet,
                                                                      for_inference=True)  # merge_to: LoRAInfModule
            built = len(network.unet_loras) + len(network.text_encoder_loras)
            network.merge_to(encoder, unet, weights, torch.float32, "cpu")
            notes = lora_notes(folder, kind, unet, encoder)
            return notes + ([f"{built} modules built"] if notes else [])
        yield kind, outcome(run)
        check.args = type("Args", (), {"show_all_keys": False})()
        out = io.StringIO()
        with contextlib.redirect_stdout(out), captured():
            check.main(str(lora_file(folder, kind)))
        listed = next(line for line in out.getvalue().splitlines() if line.startswith("number of LoRA modules"))
        with __import__("safetensors").safe_open(str(lora_file(folder, kind)), "pt") as handle:
            total = len(list(handle.keys()))
        yield kind, f"check_lora_weights: lists {listed.split(': ')[1]} of {total} tensors"


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str]) -> int:
    if argv[:1] == ["write"]:
        write(Path(argv[1]))
        return 0
    if argv[:1] == ["read"]:
        read(Path(argv[1]))
        return 0
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="readers_"))
    write(folder)
    print(f"{'kind':<22} | {'reader':<32} | outcome", flush=True)
    sd_scripts = os.environ.pop("SD_SCRIPTS", None)  # sd-scripts runs in the other venv (its pinned diffusers)
    read(folder)
    other = os.environ.get("READERS_PYTHON")
    if other:
        # the checkout's packages (networks, library) are importable in that process through its PYTHONPATH
        env = {**os.environ, **({"SD_SCRIPTS": sd_scripts, "PYTHONPATH": os.pathsep.join(
            filter(None, [sd_scripts, os.environ.get("PYTHONPATH")]))} if sd_scripts else {})}
        subprocess.run([other, __file__, "read", str(folder)], check=True, env=env)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
