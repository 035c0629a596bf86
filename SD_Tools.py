"""The tools around a trained file: a LoRA extracted from two models, a LoRA resized to a lower rank, models merged.

    python SD_Tools.py extract --tuned my_model.safetensors --base v1-5-pruned-emaonly.safetensors \\
        --out my_model_lora.safetensors [--rank 32] [--conv_rank 16] [--dynamic sv_fro --dynamic_param 0.9]
    python SD_Tools.py resize --lora big.safetensors --out small.safetensors --rank 8 [--dynamic sv_ratio \\
        --dynamic_param 8]
    python SD_Tools.py merge --a A.safetensors --b B.safetensors [--c C.safetensors] --out merged.safetensors \\
        [--alpha 0.5] [--block_alphas 25,VALUES] [--text_encoder merge|a|b] [--vae a|b|merge]

``extract``: the difference of ``--tuned`` and ``--base`` (single files, diffusers folders or hub ids, runs of
ours: their EMA weights) as a LoRA, by truncated SVD per layer: the UNet's transformer layers, its 3x3
convolutions with ``--conv_rank`` (LoCon), the text encoder's attention and MLP unless the two text encoders
differ by under ``--min_diff`` everywhere. ``resize``: a LoRA, LoCon or DoRA file (kohya or diffusers layout) at
a lower rank, each layer's scale and DoRA magnitude kept. The rank is ``--rank`` for every layer, or with
``--dynamic`` chosen per layer from its singular values (``sv_ratio``, ``sv_fro``, ``sv_cumulative`` with
``--dynamic_param``, as kohya's resize_lora.py names them) and at most ``--rank``. One layer is read at a time,
the output written atomically in the kohya layout (ComfyUI, AUTOMATIC1111, sd-scripts, diffusers) with a
header saying what was done, and a per-layer report of the rank and the share of the Frobenius norm kept
beside it (``OUT.report.csv``). ``merge``: a weighted sum of two models or A + alpha (B - C) of three, per UNet
block with ``--block_alphas`` (``sd.checkpoint_merge``), into one single file written a tensor at a time.
Exit 0 when written, 2 with one line when it cannot run.
"""

from __future__ import annotations

import csv
import io
import logging
import signal
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError

import sd.checkpoint_merge
import sd.cli
import sd.embedding.formats
import sd.files
import sd.formats
import sd.lora.formats
import sd.lora.tools
import sd.metadata
import sd.model
import sd.model_weights
import sd.runtime
from sd.lora.lowrank import RANK_METHODS, RankRule

log = logging.getLogger("sd_tools")
ERRORS = (KeyError, ValueError, OSError, SafetensorError, sd.model.LoadError)
SAVE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def add_rank_flags(parser, default_rank: int) -> None:
    parser.add_argument("--rank", type=int, default=default_rank, help="rank of the Linear and 1x1 layers; with "
                        "--dynamic the most any layer keeps (default: %(default)s)")
    parser.add_argument("--conv_rank", type=int, default=None, help="rank of the 3x3 convolutions (LoCon); extract: "
                        "without it they are left out; resize: without it they follow --rank")
    parser.add_argument("--dynamic", choices=RANK_METHODS[1:], default=None,
                        help="choose each layer's rank from its singular values: sv_ratio (those above the largest "
                        "/ param), sv_fro (the fewest holding a share param of the Frobenius norm), sv_cumulative "
                        "(the fewest holding a share param of their sum)")
    parser.add_argument("--dynamic_param", type=float, default=None, help="the ratio (> 1) or share (0-1] of --dynamic")
    parser.add_argument("--clamp_quantile", type=float, default=None, help="clamp the factors' entries at this "
                        "quantile of their magnitudes, as kohya's extraction does (1: not clamped; default: 0.99 "
                        "for extract, 1 for resize)")
    parser.add_argument("--save_precision", choices=tuple(SAVE_DTYPES), default="fp16",
                        help="dtype of the written factors (default: %(default)s)")


def parse_args(argv=None):
    parser = sd.cli.ArgumentParser(prog="SD_Tools.py", description=__doc__, formatter_class=sd.cli.HelpFormatter)
    tools = parser.add_subparsers(dest="tool", required=True)
    extract = tools.add_parser("extract", help="a LoRA from the difference of two models")
    extract.add_argument("--tuned", required=True, help="the fine-tuned model: a single file, a diffusers folder or "
                         "hub id, or a run of ours")
    extract.add_argument("--base", required=True, help="the model it was tuned from (the same kinds)")
    extract.add_argument("--out", required=True, help="the LoRA file to write (.safetensors)")
    add_rank_flags(extract, 32)
    extract.add_argument("--text_encoder", choices=("auto", "false"), default="auto", help="auto: extracted unless "
                         "the text encoders differ by under --min_diff everywhere; false: the UNet alone")
    extract.add_argument("--min_diff", type=float, default=0.01, help="see --text_encoder (default: %(default)s)")
    resize = tools.add_parser("resize", help="a LoRA at a lower rank")
    resize.add_argument("--lora", required=True, help="the LoRA, LoCon or DoRA file (kohya or diffusers layout)")
    resize.add_argument("--out", required=True, help="the LoRA file to write (.safetensors)")
    add_rank_flags(resize, 8)
    merge = tools.add_parser("merge", help="two models (weighted sum) or three (add difference) into one file")
    merge.add_argument("--a", required=True, help="model A: a single file, diffusers folder or hub id, or a run of ours")
    merge.add_argument("--b", required=True, help="model B (the same kinds)")
    merge.add_argument("--c", default=None, help="model C, for add_difference: A + alpha (B - C)")
    merge.add_argument("--out", required=True, help="the single file to write (.safetensors, original layout), or a "
                       "diffusers pipeline folder (any other name)")
    merge.add_argument("--method", choices=sd.checkpoint_merge.METHODS, default=None,
                       help="weighted_sum: (1 - alpha) A + alpha B; add_difference: A + alpha (B - C) (default: "
                       "add_difference with --c, else weighted_sum)")
    merge.add_argument("--alpha", type=float, default=0.5, help="the ratio (default: %(default)s); with "
                       "--block_alphas, that of the UNet's tensors outside the blocks and of a merged text encoder "
                       "and VAE")
    merge.add_argument("--block_alphas", default=None, help="25 comma-separated ratios for the UNet's blocks IN00-IN11, "
                       "M00, OUT00-OUT11 (as the block-merge tools order them)")
    merge.add_argument("--text_encoder", choices=sd.checkpoint_merge.SIDES, default="merge",
                       help="merge the text encoders, or take A's or B's (default: %(default)s)")
    merge.add_argument("--vae", choices=sd.checkpoint_merge.SIDES, default="a",
                       help="take A's VAE, B's, or merge them (default: %(default)s)")
    merge.add_argument("--save_precision", choices=tuple(SAVE_DTYPES), default="fp16",
                       help="dtype of the written weights (default: %(default)s)")
    join = tools.add_parser("merge-lora", help="LoRAs joined into one LoRA (exactly: their ranks concatenated; "
                            "--rank N refactors it), or merged into a model (--into)")
    join.add_argument("--lora", action="append", required=True, metavar="FILE[:RATIO[:BLOCKS]]",
                      help="a LoRA file and its ratio (default 1), with --into also a block-weight vector as "
                      "SD_ImageGen.py --lora takes it; repeat for each")
    join.add_argument("--out", required=True, help="the file to write (.safetensors): a LoRA, or with --into a model "
                      "(a single file, or a diffusers pipeline folder: any other name)")
    join.add_argument("--into", default=None, help="merge into this model (a single file, diffusers folder or hub "
                      "id, run of ours) and write it as one single file; LoHa, LoKr and DoRA files too")
    add_rank_flags(join, 0)
    args = parser.parse_args(argv)
    model_out = args.tool == "merge" or (args.tool == "merge-lora" and args.into)
    if not args.out.endswith(".safetensors") and not model_out:
        parser.error(f"--out {args.out}: a .safetensors file")
    return args, parser


def written_as(out: str, write) -> Path:
    """``write(single_file)`` into ``out``: a ``.safetensors`` single file, or else a diffusers pipeline folder
    converted from it (the single file then removed; the folder written atomically)."""
    if out.endswith(".safetensors"):
        return write(out)
    folder = Path(out)
    single = folder.with_name(f".{folder.name}.single.safetensors")
    try:
        write(str(single))
        pipeline = sd.formats.load_pipeline(str(single))
        sd.formats.export_diffusers(folder, pipeline.unet, pipeline.vae, pipeline.text_encoder, pipeline.tokenizer,
                                    pipeline.prediction_type)
    finally:
        single.unlink(missing_ok=True)
    return folder


def merge_settings_of(args, parser) -> sd.checkpoint_merge.MergeSettings:
    method = args.method or ("add_difference" if args.c else "weighted_sum")
    blocks = None
    if args.block_alphas:
        try:
            blocks = tuple(float(v) for v in args.block_alphas.split(","))
        except ValueError:
            parser.error(f"--block_alphas: comma-separated numbers, got {args.block_alphas!r}")
    try:
        return sd.checkpoint_merge.MergeSettings(method, args.alpha, blocks, args.text_encoder, args.vae,
                                                 SAVE_DTYPES[args.save_precision]).check()
    except ValueError as problem:
        parser.error(f"--{problem}")


def run_merge_lora(args, settings) -> tuple[Path, list[dict]]:
    """Joined into one LoRA (exact: the ranks concatenated; with --rank, refactored to it), or merged into
    --into's model."""
    import sd.imagegen.lora  # SD_ImageGen.py's own reading of FILE:SCALE

    specs = [sd.imagegen.lora.parse_lora_blocks(spec) for spec in args.lora]
    if any(blocks for *_, blocks in specs) and not args.into:
        raise ValueError("block weights (FILE:RATIO:BLOCKS) scale a LoRA merged into a model: give --into")
    loras = [(sd.lora.tools.read_lora_file(path)[0], ratio, blocks) for path, ratio, blocks in specs]
    files = [sd.lora.formats.lora_file(path) for path, *_ in specs]
    sources = {"loras": [f"{sd.metadata.public_name(str(path))}:{ratio:g}" for path, ratio, _ in specs]}
    if args.into:
        sources["into"] = sd.metadata.public_name(args.into)
        path = written_as(args.out, lambda out: sd.checkpoint_merge.bake(args.into, loras, out, settings.dtype,
                                                                         sources))
        tokens = sd.lora.tools.joined_tokens(files)
        beside = path.parent if path.suffix == ".safetensors" else path
        for token, vectors in tokens.items():  # a checkpoint has no place for a new token: its file goes beside
            written = sd.embedding.formats.write_embedding(sd.embedding.formats.embedding_output(beside, token),
                                                           token, vectors)
            log.info("wrote the bundled token %s beside it: %s (load it as an embedding)", token, written)
        return path, []
    lora = sd.lora.tools.concatenate([(lora, ratio) for lora, ratio, _ in loras])
    report = []
    if args.rank:
        lora, report = sd.lora.tools.resize(lora, settings)
    else:
        lora = {part: {m: layer._replace(down=layer.down.to(settings.dtype), up=layer.up.to(settings.dtype))
                       for m, layer in modules.items()} for part, modules in lora.items()}
    _, _, preset = sd.lora.tools.read_lora_file(files[0])
    unet = sd.model.empty_model("unet", sd.model.FILE_CONFIGS["unet"][preset])
    header = sd.lora.tools.tool_header("merge-lora", Path(args.out).stem, settings, sources, report,
                                       sd.metadata.model_resolution(unet))
    tokens = sd.lora.tools.joined_tokens(files)
    return sd.lora.formats.save_lora(args.out, lora, "kohya", metadata=header, embeddings=tokens or None), report


def run_merge(args, settings) -> Path:
    sources = {"a": args.a, "b": args.b, **({"c": args.c} if args.c else {})}
    return written_as(args.out, lambda out: sd.checkpoint_merge.merge(sources, out, settings))


def settings_of(args, parser) -> sd.lora.tools.ExtractSettings:
    if (args.dynamic is None) != (args.dynamic_param is None):
        parser.error("--dynamic and --dynamic_param go together")
    method, param = args.dynamic or "fixed", args.dynamic_param or 0.0
    clamp = args.clamp_quantile if args.clamp_quantile is not None else (0.99 if args.tool == "extract" else 1.0)
    if not 0 < clamp <= 1:
        parser.error(f"--clamp_quantile must be in (0, 1], got {clamp}")
    try:
        joined = args.tool == "merge-lora" and args.rank == 0  # the ranks joined as they are: no rule
        rule = RankRule(1 if joined else args.rank, method, param).check("--rank")
        conv = RankRule(args.conv_rank, method, param).check("--conv_rank") if args.conv_rank is not None else None
    except ValueError as problem:
        parser.error(str(problem))
    text = getattr(args, "text_encoder", "auto") == "auto"
    return sd.lora.tools.ExtractSettings(rule, conv, text, clamp, getattr(args, "min_diff", 0.0),
                                         SAVE_DTYPES[args.save_precision])


def run_extract(args, settings) -> tuple[Path, list[dict]]:
    lora, report = sd.lora.tools.extract(args.tuned, args.base, settings)
    unet = sd.model_weights.WeightReader(args.tuned, "unet").model
    header = sd.lora.tools.tool_header("extract", Path(args.out).stem, settings,
                                       {"tuned": args.tuned, "base": args.base}, report,
                                       sd.metadata.model_resolution(unet), sd.formats.recorded_prediction_type(args.tuned))
    return sd.lora.formats.save_lora(args.out, lora, "kohya", metadata=header), report


def run_resize(args, settings) -> tuple[Path, list[dict]]:
    lora, header, preset = sd.lora.tools.read_lora_file(args.lora)
    resized, report = sd.lora.tools.resize(lora, settings)
    unet = sd.model.empty_model("unet", sd.model.FILE_CONFIGS["unet"][preset])
    kept = {k: v for k, v in header.items() if k.startswith("ss_") and k not in sd.lora.formats.NETWORK_KEYS}
    prediction = next((k for k, v in sd.metadata.PREDICTION_KEYS.items()
                       if v == header.get("modelspec.prediction_type")), "epsilon")
    new = sd.lora.tools.tool_header("resize", Path(args.out).stem, settings, {"lora": args.lora}, report,
                                    sd.metadata.model_resolution(unet), prediction)
    bundled = sd.lora.formats.read_bundled_embeddings(args.lora)
    return sd.lora.formats.save_lora(args.out, resized, "kohya", metadata={**kept, **new},
                                     embeddings=bundled or None), report


def write_report(out: Path, report: list[dict]) -> Path:
    """``OUT.report.csv``: one row per layer (part, module, rank, full rank, Frobenius share kept)."""
    path = out.with_name(out.name.removesuffix(".safetensors") + ".report.csv")
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=["part", "module", "rank", "full_rank", "fro_kept"])
    writer.writeheader()
    writer.writerows({**row, "fro_kept": f"{row['fro_kept']:.6f}"} for row in report)
    sd.files.write_text_atomic(path, text.getvalue())
    return path


def main(argv=None) -> int:
    sd.runtime.start_process()
    args, parser = parse_args(argv)
    if args.tool == "merge-lora" and not args.rank and (args.dynamic or args.conv_rank):
        parser.error("--dynamic and --conv_rank refactor the joined LoRA to --rank: give --rank too")
    settings = merge_settings_of(args, parser) if args.tool == "merge" else settings_of(args, parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    if args.tool == "merge":
        try:
            path = run_merge(args, settings)
        except ERRORS as error:
            print(f"SD_Tools.py merge: {sd.cli.first_line(error)}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("SD_Tools.py merge: interrupted (Ctrl-C); nothing was written", file=sys.stderr)
            return 128 + signal.SIGINT
        print(f"wrote {path}")
        return 0
    try:
        run = {"extract": run_extract, "resize": run_resize, "merge-lora": run_merge_lora}[args.tool]
        path, report = run(args, settings)
        if not report:
            print(f"wrote {path}")
            return 0
        written = write_report(path, report)
    except ERRORS as error:
        print(f"SD_Tools.py {args.tool}: {sd.cli.first_line(error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"SD_Tools.py {args.tool}: interrupted (Ctrl-C); nothing was written", file=sys.stderr)
        return 128 + signal.SIGINT
    kept = [row["fro_kept"] for row in report]
    ranks = sorted({row["rank"] for row in report})
    print(f"wrote {path}: {len(report)} layers, rank {ranks[0]}-{ranks[-1]}, Frobenius share kept {min(kept):.3f} "
          f"(least) / {sum(kept) / len(kept):.3f} (mean); per layer in {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
