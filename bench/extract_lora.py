"""Benchmark: extracting a LoRA from two full-size SD 1.x checkpoints, ours against kohya-ss/sd-scripts.

    python bench/extract_lora.py                   # SD 1.x size: two ~2 GB fp16 single files
    python bench/extract_lora.py --size tiny       # the tiny CPU presets (ours alone: see below)

The pair is written here first, in the original LDM layout and fp16 as community checkpoints are: ``base``
with random weights, ``tuned`` = base plus a random rank-``--delta_rank`` change of scale ``--delta_scale`` on
every attention projection of the UNet (attn1 / attn2 to_q, to_k, to_v, to_out.0) and on the text encoder's
q/k/v/out projections, so both parts are extracted (the change is above both tools' ``min_diff`` of 0.01).
The models are freed before anything is measured. Then, each in a fresh child process whose peak resident
memory is its own ``VmHWM`` (read at its exit, see ``PEAK_RSS``):

- ours: ``SD_Tools.py extract --tuned T --base B --out OUT --rank R`` (``SD_Tools.main(argv)`` in a two-line
  wrapper), which reads one layer at a time (``sd.model_weights``);
- kohya: sd-scripts' ``networks/extract_lora_from_models.py --model_org B --model_tuned T --save_to OUT
  --dim R --device cpu --save_precision fp16`` (``runpy`` in a short wrapper), in its own venv
  (``--kohya_python``, a checkout at ``--sd_scripts``), offline (``HF_HUB_OFFLINE=1``: for SD 1.x it builds
  its UNet and CLIP-L from configs in ``library/model_util.py`` and downloads nothing). ``library/utils.py``
  and ``library/train_util.py`` (imported when the LoRA is saved) import torchvision for image helpers extraction
  never calls: where it is not installed, a stand-in module (its ``transforms.X(...)`` all give None) is put in
  ``sys.modules`` of that child only. Saving also needs ``imagesize`` and ``voluptuous`` in that venv. It
  builds SD 1.x's own architecture whatever the file holds, so with ``--size tiny`` it is left out.

Both get the same rank, conv rank and ``--clamp_quantile`` (kohya's default, 0.99). Seconds are each child's
whole wall time (interpreter start and imports included: what a user waits), the best of ``--repeats``; peak
RSS the largest over them. The reference is the naive way: the base, the tuned model and their difference
held whole in fp32 (3x the UNet + text encoder). Then both files are compared: their key sets, and for a few
layers (5 UNet attention projections, 2 text-encoder ones) ``up @ down * alpha / rank`` against the true
difference (tuned - base, fp32 from the files), with the best rank-R error (the SVD unclamped) beside it.
Prints a table and the ratios kohya/ours, and ends with one JSON line.
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
TOOLS = ("ours", "kohya")
UNET_CHANGED = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0")
TEXT_CHANGED = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj")
CHECKED = {"unet": 5, "text_encoder": 2}  # layers compared with the true difference, spread over the model

# The children: each prints one JSON line last, its VmHWM at exit. Not wait4's ru_maxrss: Linux carries the
# parent's high-water mark into a child at exec (see bench/single_file.py, peak_rss_gb).
PEAK_RSS = """
import json, sys
def peak_rss_gb():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 2**20  # kB
"""
OURS_CHILD = PEAK_RSS + """
import SD_Tools
code = SD_Tools.main(sys.argv[1:])
print(json.dumps({"rc": code, "peak_rss_gb": peak_rss_gb()}))
"""
KOHYA_CHILD = PEAK_RSS + """
import importlib.util, runpy, types
root = sys.argv[1]
sys.path[:0] = [root, root + "/networks"]  # its scripts import both `library...` and `lora`
import diffusers, transformers  # first: both ask importlib whether torchvision exists, which a stand-in cannot answer
def unused(name):  # transforms.Compose(...) etc. run at import (train_util's IMAGE_TRANSFORMS), never called after
    if name.startswith("_"):
        raise AttributeError(name)
    return lambda *args, **kwargs: None
if importlib.util.find_spec("torchvision") is None:  # library/utils.py, train_util.py import it for image helpers
    stub = types.ModuleType("torchvision")
    stub.transforms = types.ModuleType("torchvision.transforms")
    stub.transforms.__getattr__ = unused
    sys.modules.update({"torchvision": stub, "torchvision.transforms": stub.transforms})
script = root + "/networks/extract_lora_from_models.py"
sys.argv = [script, *sys.argv[2:]]
runpy.run_path(script, run_name="__main__")
print(json.dumps({"rc": 0, "peak_rss_gb": peak_rss_gb()}))
"""


# ---------------------------------------------------------------------------------------------
# The inputs: a base and a tuned single file
# ---------------------------------------------------------------------------------------------


def random_models(size: str):
    """UNet, VAE and CLIP text encoder of ``size`` (``sd1`` or ``tiny``) with random weights."""
    import sd.model

    unet = sd.model.build_unet(harness.unet_preset(size), seed=0, from_scratch=False)
    return unet.eval(), harness.random_vae(size), harness.random_text_encoder(size)


def add_low_rank_change(model, suffixes: tuple[str, ...], rank: int, scale: float, seed: int) -> list[str]:
    """Adds ``scale * A @ B / sqrt(rank)`` (A, B standard normal: entries of std ``scale``) to the weight of
    every Linear whose name ends with one of ``suffixes``; returns their names."""
    generator = torch.Generator().manual_seed(seed)
    changed = []
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name.endswith(suffixes):
                out_features, in_features = module.weight.shape
                a = torch.randn(out_features, rank, generator=generator)
                b = torch.randn(rank, in_features, generator=generator)
                module.weight += scale * (a @ b) / rank**0.5
                changed.append(name)
    return changed


def write_pair(work: Path, size: str, rank: int, scale: float) -> tuple[Path, Path, dict[str, list[str]]]:
    """``work/base.safetensors`` and ``work/tuned.safetensors`` (fp16, original layout), and the names of the
    changed layers per part; the models are freed before this returns."""
    import sd.formats

    base, tuned = work / "base.safetensors", work / "tuned.safetensors"
    unet, vae, text_encoder = random_models(size)
    sd.formats.save_single_file(base, unet, vae, text_encoder, half=True)
    changed = {"unet": add_low_rank_change(unet, UNET_CHANGED, rank, scale, seed=10),
               "text_encoder": add_low_rank_change(text_encoder, TEXT_CHANGED, rank, scale, seed=11)}
    sd.formats.save_single_file(tuned, unet, vae, text_encoder, half=True)
    del unet, vae, text_encoder
    gc.collect()
    return base, tuned, changed


# ---------------------------------------------------------------------------------------------
# The children: one tool each, in a process of its own
# ---------------------------------------------------------------------------------------------


def tool_command(tool: str, base: Path, tuned: Path, out: Path, args) -> tuple[list[str], Path]:
    """``(command, working directory)`` of ``tool``'s child."""
    if tool == "ours":
        command = [sys.executable, "-c", OURS_CHILD, "extract", "--tuned", str(tuned), "--base", str(base),
                   "--out", str(out), "--rank", str(args.rank), "--clamp_quantile", str(args.clamp_quantile),
                   "--save_precision", "fp16"]
        conv = ["--conv_rank", str(args.conv_rank)] if args.conv_rank else []
        return command + conv, ROOT
    command = [args.kohya_python, "-c", KOHYA_CHILD, args.sd_scripts, "--model_org", str(base), "--model_tuned",
               str(tuned), "--save_to", str(out), "--dim", str(args.rank), "--device", "cpu", "--save_precision",
               "fp16", "--clamp_quantile", str(args.clamp_quantile)]
    conv = ["--conv_dim", str(args.conv_rank)] if args.conv_rank else []
    return command + conv, Path(args.sd_scripts)


def run_tool(tool: str, base: Path, tuned: Path, out: Path, args) -> dict:
    """One run of ``tool``: its wall seconds and peak RSS. Its stderr (progress bars, logs) is shown only if
    it fails, as a RuntimeError."""
    command, cwd = tool_command(tool, base, tuned, out, args)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    with tempfile.TemporaryFile(mode="w+") as stderr:
        start = time.perf_counter()
        process = subprocess.run(command, stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=cwd, env=env)
        seconds = time.perf_counter() - start
        last = (process.stdout.strip().splitlines() or [""])[-1]
        if process.returncode != 0 or not last.startswith("{") or json.loads(last)["rc"] != 0:
            stderr.seek(0)
            text = stderr.read().strip()
            raise RuntimeError(f"{tool} child failed ({process.returncode}): {text.splitlines()[-1] if text else ''}\n"
                               f"{text[-3000:]}")
    return {"seconds": seconds, "peak_rss_gb": json.loads(last)["peak_rss_gb"]}


def kohya_unavailable(args) -> str | None:
    """Why kohya's script cannot run here (None: it can)."""
    if args.size != "sd1":
        return "sd-scripts builds the SD 1.x UNet and CLIP-L from fixed configs: a tiny file does not fit them"
    script = Path(args.sd_scripts) / "networks" / "extract_lora_from_models.py"
    if not script.is_file():
        return f"no {script} (--sd_scripts: a checkout of kohya-ss/sd-scripts)"
    if not Path(args.kohya_python).is_file():
        return f"no {args.kohya_python} (--kohya_python: a venv with torch, diffusers 0.32, transformers 4.49)"
    return None


def measure(base: Path, tuned: Path, work: Path, args) -> list[dict]:
    """Per tool: the best seconds of ``repeats`` fresh children and the largest peak RSS among them."""
    rows = []
    for tool in TOOLS:
        out = work / f"lora_{tool}.safetensors"
        skipped = kohya_unavailable(args) if tool == "kohya" else None
        if skipped:
            rows.append({"tool": tool, "out": None, "skipped": skipped})
            continue
        try:
            runs = [run_tool(tool, base, tuned, out, args) for _ in range(args.repeats)]
        except RuntimeError as failure:
            print(failure, file=sys.stderr)
            rows.append({"tool": tool, "out": None, "error": sd.cli.first_line(failure)})
            continue
        rows.append({"tool": tool, "out": str(out), "seconds": min(r["seconds"] for r in runs),
                     "peak_rss_gb": max(r["peak_rss_gb"] for r in runs)})
    return rows


# ---------------------------------------------------------------------------------------------
# The files compared: key sets, and a few layers against the true difference
# ---------------------------------------------------------------------------------------------


def checked_layers(changed: dict[str, list[str]]) -> list[tuple[str, str]]:
    """``(part, module)``: ``CHECKED[part]`` of the changed layers, evenly spread over each part."""
    out = []
    for part, count in CHECKED.items():
        names = changed[part]
        out += [(part, names[round(i * (len(names) - 1) / max(count - 1, 1))]) for i in range(count)]
    return out


def lora_weight(handle, key: str, shape) -> torch.Tensor:
    """``up @ down * alpha / rank`` of layer ``key`` in an open LoRA file, in ``shape`` (fp32)."""
    down = handle.get_tensor(f"{key}.lora_down.weight").float()
    up = handle.get_tensor(f"{key}.lora_up.weight").float()
    rank = down.shape[0]
    alpha = float(handle.get_tensor(f"{key}.alpha")) if f"{key}.alpha" in handle.keys() else rank
    return (up.flatten(1) @ down.flatten(1)).reshape(shape) * alpha / rank


def compare(base: Path, tuned: Path, files: dict[str, str], changed: dict[str, list[str]], rank: int) -> dict:
    """The key sets of ``files`` (tool: path) and, per checked layer, each tool's relative Frobenius error
    against tuned - base, the best rank-``rank`` error, and the tools' difference from each other."""
    from safetensors import safe_open

    import sd.lora.formats
    import sd.model_weights

    handles = {tool: safe_open(path, framework="pt") for tool, path in files.items()}
    keys = {tool: set(handle.keys()) for tool, handle in handles.items()}
    layers = []
    for part, module in checked_layers(changed):
        name = f"{module}.weight"
        delta = sd.model_weights.WeightReader(tuned, part).read([name])[name] - \
            sd.model_weights.WeightReader(base, part).read([name])[name]
        key = sd.lora.formats.KOHYA_PREFIXES[part] + sd.lora.formats.lora_file_name(part, module).replace(".", "_")
        singular = torch.linalg.svdvals(delta.flatten(1).double())
        row = {"part": part, "module": module, "key": key,
               "best": float(singular[rank:].square().sum().sqrt() / singular.square().sum().sqrt())}
        weights = {tool: lora_weight(handle, key, delta.shape) for tool, handle in handles.items() if key + ".alpha"
                   in keys[tool] or key + ".lora_down.weight" in keys[tool]}
        row.update({tool: float((w - delta).norm() / delta.norm()) for tool, w in weights.items()})
        if len(weights) == 2:
            row["ours_vs_kohya"] = float((weights["ours"] - weights["kohya"]).norm() / delta.norm())
        layers.append(row)
    common = set.intersection(*keys.values()) if keys else set()
    return {"keys": {tool: len(k) for tool, k in keys.items()}, "common": len(common),
            "only": {tool: sorted(k - common)[:3] for tool, k in keys.items()}, "layers": layers}


def naive_gb(base: Path) -> float:
    """The naive way's memory: base, tuned and their difference held whole in fp32, UNet + text encoder."""
    from safetensors import safe_open

    with safe_open(str(base), framework="pt") as handle:
        count = sum(torch.Size(handle.get_slice(k).get_shape()).numel() for k in handle.keys()
                    if k.startswith(("model.diffusion_model.", "cond_stage_model.")))
    return 3 * 4 * count / 2**30


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------


def report(rows: list[dict], check: dict, naive: float, args, base: Path) -> dict:
    by_tool = {row["tool"]: row for row in rows}
    ours, kohya = by_tool["ours"], by_tool["kohya"]
    print(f"pair: 2 x {base.stat().st_size / 1e9:.2f} GB ({args.size}, fp16, original layout); rank {args.rank}, "
          f"conv rank {args.conv_rank or '-'}, clamp_quantile {args.clamp_quantile}; {torch.get_num_threads()} "
          f"threads; best of {args.repeats}, each a fresh process (its whole wall time, imports included)")
    labels = {"ours": "ours: SD_Tools.py extract", "kohya": "kohya: extract_lora_from_models.py"}
    harness.print_table([row for row in rows if "skipped" not in row], lambda row: labels[row["tool"]],
                        [("seconds", "seconds", ".1f"), ("peak_rss_gb", "peak RSS GB", ".2f")])
    print(f"{'naive: base, tuned, difference whole (fp32)':44}{'-':>12}{naive:>12.2f}")
    for row in rows:
        if "skipped" in row:
            print(f"{row['tool']}: not run: {row['skipped']}")
    ratios = None
    if not {"error", "skipped"} & (kohya.keys() | ours.keys()):
        ratios = {"seconds": kohya["seconds"] / ours["seconds"], "peak_rss": kohya["peak_rss_gb"] / ours["peak_rss_gb"]}
        print(f"ratio kohya/ours: time {ratios['seconds']:.2f}x, peak RSS {ratios['peak_rss']:.2f}x")
    below = None
    if "error" not in ours:
        below = naive / ours["peak_rss_gb"]
        print(f"ours: peak RSS {ours['peak_rss_gb']:.2f} GB, naive {naive:.2f} GB ({below:.2f}x): peak memory at least "
              "2x below loading three whole models: " + ("yes" if below >= 2 else "NO"))
    if check:
        print_check(check)
    rounded = [{k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()} for row in rows]
    return {"size": args.size, "file_gb": round(base.stat().st_size / 1e9, 3), "rank": args.rank,
            "conv_rank": args.conv_rank, "clamp_quantile": args.clamp_quantile, "repeats": args.repeats,
            "rows": rounded, "naive_gb": round(naive, 3),
            "ratio_kohya_over_ours": ratios and {k: round(v, 3) for k, v in ratios.items()},
            "ours_below_naive": below and round(below, 2), "check": check}


def print_check(check: dict) -> None:
    counts = ", ".join(f"{tool} {n}" for tool, n in check["keys"].items())
    print(f"keys: {counts}; in common {check['common']}"
          + "".join(f"; only {tool}'s, e.g. {only}" for tool, only in check["only"].items() if only))
    tools = [t for t in TOOLS if t in check["keys"]]
    print("relative Frobenius error against tuned - base (fp32), per layer; best: the unclamped rank-r SVD's")
    print(f"{'layer':72}{'best':>10}" + "".join(f"{t:>10}" for t in tools) + ("  ours vs kohya" if len(tools) == 2
                                                                                  else ""))
    for row in check["layers"]:
        cells = "".join(f"{row[t]:>10.4f}" if t in row else f"{'missing':>10}" for t in tools)
        both = f"{row['ours_vs_kohya']:>15.4f}" if "ours_vs_kohya" in row else ""
        print(f"{row['key']:72}{row['best']:>10.4f}{cells}{both}")


def main(argv=None) -> dict:
    parser = sd.cli.ArgumentParser(description=__doc__)
    parser.add_argument("--size", choices=("sd1", "tiny"), default="sd1", help="model size of the pair")
    parser.add_argument("--repeats", type=int, default=1, help="runs per tool, the best one counts")
    parser.add_argument("--rank", type=int, default=32, help="the LoRA's rank (ours --rank, kohya --dim)")
    parser.add_argument("--conv_rank", type=int, default=None, help="the 3x3 convolutions' rank (LoCon; ours "
                        "--conv_rank, kohya --conv_dim); without it they are left out by both")
    parser.add_argument("--clamp_quantile", type=float, default=0.99, help="passed to both (kohya's default)")
    parser.add_argument("--delta_rank", type=int, default=8, help="rank of the change that makes the tuned model")
    parser.add_argument("--delta_scale", type=float, default=1e-2, help="std of that change's entries")
    parser.add_argument("--sd_scripts", default=os.environ.get("SD_SCRIPTS", "/tmp/sdscripts"),
                        help="a checkout (or git archive) of kohya-ss/sd-scripts: its networks/ and library/")
    parser.add_argument("--kohya_python", default=os.environ.get("KOHYA_PYTHON", "/tmp/readers/bin/python"),
                        help="the python of a venv where sd-scripts runs (torch, diffusers 0.32, transformers 4.49)")
    parser.add_argument("--work", default="", help="write the pair and the LoRAs here (kept), not in a temporary one")
    parser.add_argument("--json", default="", help="also write the result JSON to this file")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.rank < 1:
        parser.error("--repeats and --rank: whole numbers >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        base, tuned, changed = write_pair(work, args.size, args.delta_rank, args.delta_scale)
        print(f"wrote {base} and {tuned} in {time.perf_counter() - start:.0f} s ({len(changed['unet'])} UNet and "
              f"{len(changed['text_encoder'])} text-encoder layers changed, rank {args.delta_rank}, "
              f"std {args.delta_scale:g})")
        rows = measure(base, tuned, work, args)
        files = {row["tool"]: row["out"] for row in rows if row.get("out")}
        check = compare(base, tuned, files, changed, args.rank) if files else {}
        result = report(rows, check, naive_gb(base), args, base)
    harness.emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
