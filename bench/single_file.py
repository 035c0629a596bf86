"""Benchmark: reading an SD 1.x single file into models, ours against diffusers' ``from_single_file``.

    python bench/single_file.py                    # SD 1.x size: a ~2 GB fp16 file (UNet 860M, VAE 84M, CLIP-L 123M)
    python bench/single_file.py --size tiny        # the tiny CPU presets (the smoke test)

The file is written here first, in the original LDM layout and fp16, from random weights
(``sd.formats.save_single_file``), beside a diffusers folder of the same architecture (fp16) that
diffusers' reader takes as its ``config=`` (offline, ``HF_HUB_OFFLINE=1``). Then, each in a fresh child
process so the peak resident memory (its ``VmHWM``, see ``peak_rss_gb``) is its own:

- ours: ``sd.formats.load_pipeline(path)`` (the architecture found from the tensors' shapes, each model built
  on the meta device and given only its own tensors), and each part alone,
  ``sd.model.model_from_file(sd.model.open_file(path), part)``;
- diffusers: ``StableDiffusionPipeline.from_single_file(path, config=folder, local_files_only=True,
  torch_dtype=torch.float32)``;
- the floor: a child that only imports what both readers import (every child imports it before its clock starts).

A warm-up comes first: one untimed load by both readers in one child, which is also the check that every
tensor of ours equals diffusers' bit for bit (UNet, VAE, text encoder). The file is then in the page cache for
every timed load. Seconds are the best of ``--repeats``; peak RSS the largest over them.
Prints a table and the ratios diffusers/ours, and ends with one JSON line.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import sd.cli
from bench import harness

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("unet", "vae", "text_encoder")
READERS = ("floor", "ours", "diffusers", *(f"part:{part}" for part in PARTS))


# ---------------------------------------------------------------------------------------------
# The inputs: one single file and the diffusers folder of its architecture
# ---------------------------------------------------------------------------------------------


def random_models(size: str):
    """UNet, VAE and CLIP text encoder of ``size`` (``sd1`` or ``tiny``) with random weights."""
    import sd.model

    unet = sd.model.build_unet(size, seed=0, from_scratch=False)
    if size == "tiny":
        return unet, sd.model.load_vae("tiny"), sd.model.load_text_encoder("tiny")
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel

    with sd.model._seeded(2):
        vae = AutoencoderKL(**sd.model.SD1_VAE)
    with sd.model._seeded(1):
        text_encoder = CLIPTextModel(CLIPTextConfig(**sd.model.SD1_TEXT_ENCODER))
    return unet, vae.eval(), text_encoder.eval()


def write_inputs(work: Path, size: str) -> tuple[Path, Path]:
    """``work/model.safetensors`` (fp16, original layout) and ``work/diffusers`` (its models, fp16); the models
    are freed before this returns."""
    import sd.formats
    import sd.model

    path, folder = work / "model.safetensors", work / "diffusers"
    models = random_models(size)
    sd.formats.save_single_file(path, *models, half=True)
    for model in models:  # the folder is read for its configs; fp16 halves its disk and time
        model.half()
    sd.formats.export_diffusers(folder, *models, sd.model.load_tokenizer("tiny"))
    del models
    gc.collect()
    return path, folder


# ---------------------------------------------------------------------------------------------
# The children: one reader each, in a process of its own
# ---------------------------------------------------------------------------------------------


def import_readers() -> None:
    """What every child imports before its clock starts, so the floor is the same for all."""
    import diffusers  # noqa: F401
    import transformers  # noqa: F401
    from diffusers import StableDiffusionPipeline  # noqa: F401

    import sd.formats  # noqa: F401
    import sd.model  # noqa: F401


def load_ours(path: Path) -> dict:
    import sd.formats

    pipeline = sd.formats.load_pipeline(str(path))
    return {"unet": pipeline.unet, "vae": pipeline.vae, "text_encoder": pipeline.text_encoder}


def load_diffusers(path: Path, folder: Path) -> dict:
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_single_file(str(path), config=str(folder), local_files_only=True,
                                                    torch_dtype=torch.float32)
    return {"unet": pipe.unet, "vae": pipe.vae, "text_encoder": pipe.text_encoder}


def differences(ours: dict, theirs: dict) -> dict[str, list[str]]:
    """Per part, the tensor names that are not equal bit for bit (or are on one side only). The text encoder's
    names lose a leading ``text_model.``: transformers 5 state dicts have it, 4's do not."""
    out = {}
    for part in PARTS:
        a, b = ({name.removeprefix("text_model."): tensor for name, tensor in models[part].state_dict().items()}
                for models in (ours, theirs))
        out[part] = sorted(name for name in a.keys() | b.keys()
                           if name not in a or name not in b or not torch.equal(a[name], b[name]))
    return out


def child(reader: str, path: Path, folder: Path) -> dict:
    """One load by ``reader`` (``check``: both, compared); its seconds, after the imports."""
    import_readers()
    start = time.perf_counter()
    if reader == "ours":
        load_ours(path)
    elif reader == "diffusers":
        load_diffusers(path, folder)
    elif reader.startswith("part:"):
        import sd.model

        file = sd.model.open_file(path)
        start = time.perf_counter()  # the part alone: reading the file's header is timed by "ours"
        sd.model.model_from_file(file, reader.removeprefix("part:"))
    elif reader == "check":
        diff = differences(load_ours(path), load_diffusers(path, folder))
        return {"differing": {part: names[:5] for part, names in diff.items()},
                "differing_count": {part: len(names) for part, names in diff.items()}}
    return {"seconds": time.perf_counter() - start, "peak_rss_gb": peak_rss_gb()}


def peak_rss_gb() -> float:
    """This process's peak resident memory: ``VmHWM``, the high-water mark of the memory it has had since its
    ``exec``. Not ``wait4``'s ru_maxrss for the child: Linux carries the parent's high-water mark into it at
    ``exec`` (``setmax_mm_hiwater_rss``), so every child would report at least the 6.4 GB the parent peaked at
    while building the SD 1.x models."""
    status = Path("/proc/self/status")
    if status.is_file():
        return next(int(line.split()[1]) for line in status.read_text().splitlines()
                    if line.startswith("VmHWM:")) / 2**20  # kB
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**30 if sys.platform == "darwin" else 2**20)


def run_child(reader: str, path: Path, folder: Path) -> dict:
    """``reader``'s child: the JSON line it ends with (its seconds and peak RSS, or the check).
    Its stderr (diffusers' progress bars and warnings) is shown only if it fails."""
    command = [sys.executable, __file__, "--child", reader, "--work", str(path.parent)]
    with tempfile.TemporaryFile(mode="w+") as stderr:
        process = subprocess.run(command, stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=ROOT,
                                 env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if process.returncode != 0:
            stderr.seek(0)
            raise RuntimeError(f"{reader} child failed ({process.returncode}):\n{stderr.read()[-3000:]}")
    return json.loads(process.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# The measurement
# ---------------------------------------------------------------------------------------------


def measure(path: Path, folder: Path, repeats: int) -> list[dict]:
    """Per reader: the best seconds of ``repeats`` fresh children and the largest peak RSS among them."""
    rows = []
    for reader in READERS:
        runs = [run_child(reader, path, folder) for _ in range(1 if reader == "floor" else repeats)]
        rows.append({"reader": reader, "seconds": None if reader == "floor" else min(r["seconds"] for r in runs),
                     "peak_rss_gb": max(r["peak_rss_gb"] for r in runs)})
    floor = rows[0]["peak_rss_gb"]
    for row in rows:
        row["above_floor_gb"] = row["peak_rss_gb"] - floor
    return rows


LABELS = {"floor": "imports only (every child's floor)", "ours": "ours: sd.formats.load_pipeline",
          "diffusers": "diffusers: from_single_file",
          **{f"part:{part}": f"ours: model_from_file {part}" for part in PARTS}}


def report(rows: list[dict], check: dict, args, path: Path) -> dict:
    by_reader = {row["reader"]: row for row in rows}
    ours, peer = by_reader["ours"], by_reader["diffusers"]
    parts_s = sum(by_reader[f"part:{part}"]["seconds"] for part in PARTS)
    ratios = {"seconds": peer["seconds"] / ours["seconds"], "peak_rss": peer["peak_rss_gb"] / ours["peak_rss_gb"],
              # none below 10 MB above the floor (the tiny models): a ratio of noise
              "above_floor": peer["above_floor_gb"] / ours["above_floor_gb"] if ours["above_floor_gb"] > 0.01 else None}
    equal = not any(check["differing_count"].values())
    print(f"file: {path.stat().st_size / 1e9:.2f} GB ({args.size}, fp16); into fp32 models, {torch.get_num_threads()} "
          f"threads; best of {args.repeats}, each load in a fresh process after its imports")
    print("warm-up: one untimed load by each reader first (the check below), so the file is in the page cache "
          "for every timed load")
    harness.print_table(rows, lambda row: LABELS[row["reader"]],
                        [("seconds", "seconds", ".2f"), ("peak_rss_gb", "peak RSS GB", ".2f"),
                         ("above_floor_gb", "above floor", ".2f")])
    print(f"ours, the three parts one by one: {parts_s:.2f} s in all")
    above = "-" if ratios["above_floor"] is None else f"{ratios['above_floor']:.2f}x"
    print(f"ratio diffusers/ours: time {ratios['seconds']:.2f}x, peak RSS {ratios['peak_rss']:.2f}x "
          f"({above} above the floor)")
    print("check: every tensor of ours equal bit for bit to diffusers' (UNet, VAE, text encoder): "
          + ("yes" if equal else f"NO, differing {check['differing_count']}, e.g. {check['differing']}"))
    rounded = [{k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()} for row in rows]
    return {"size": args.size, "file_gb": round(path.stat().st_size / 1e9, 3), "repeats": args.repeats,
            "rows": rounded, "parts_seconds": round(parts_s, 3),
            "ratio_diffusers_over_ours": {k: v if v is None else round(v, 3) for k, v in ratios.items()},
            "bitwise_equal": equal, "differing_count": check["differing_count"]}


def main(argv=None) -> dict:
    parser = sd.cli.ArgumentParser(description=__doc__)
    parser.add_argument("--size", choices=("sd1", "tiny"), default="sd1", help="model size of the file")
    parser.add_argument("--repeats", type=int, default=3, help="timed loads per reader, the best one counts")
    parser.add_argument("--work", default="", help="write the file and folder here (kept), not in a temporary one")
    parser.add_argument("--json", default="", help="also write the result JSON to this file")
    parser.add_argument("--child", choices=(*READERS, "check"), help=argparse_hidden())
    args = parser.parse_args(argv)
    if args.child:
        work = Path(args.work)
        print(json.dumps(child(args.child, work / "model.safetensors", work / "diffusers")))
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        path, folder = write_inputs(work, args.size)
        print(f"wrote {path} and {folder} in {time.perf_counter() - start:.0f} s")
        check = run_child("check", path, folder)
        result = report(measure(path, folder, args.repeats), check, args, path)
    harness.emit(result, args.json)
    return result


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
