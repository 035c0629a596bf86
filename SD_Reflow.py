"""Draw reflow pairs: noise and the image a flow model's ODE makes of it, as training data that straightens it.

    python SD_Reflow.py --ckpt runs/flow --prompts prompts.txt --out data/reflow [--n 100000] [--steps 25]
                        [--cfg 3.0] [--negative ""] [--seed 0] [--shard_size 1000] [--batch_size 16]
    torchrun --nproc_per_node 8 SD_Reflow.py ...            # shards shared out across the ranks
    python pipeline/05_build_hf_dataset.py --captions data/reflow/captions --latents data/reflow/latents \\
        --out data/reflow/dataset --val_fraction 0
    python SD_Train.py --config configs/finetune/reflow.yaml

``--ckpt`` is a flow model (a run of ours, a diffusers folder, a single file): a ``prediction_type: flow`` one,
or an epsilon or v model trained as a flow (``flow_matching: true``, configs/finetune/flow.yaml), drawn through
the diff2flow bridge as it is sampled. Pair i
takes prompt ``i % len(prompts)`` of ``--prompts`` (one per line, or a .tsv/.csv with a ``caption``
column) and seed ``--seed + i``: its noise is the one ``SD_ImageGen.py --seed`` draws, its image the
model's solution of the flow ODE from it (``--sampler``, ``--steps``, ``--cfg``, ``--flow_shift``: the
recorded shift unless given). ``OUT/latents`` then holds each shard's latents and noise, ``OUT/captions``
its captions (stage 04's layout); stage 05 joins them into the dataset a ``reflow: true`` run trains on.

Each shard of ``--shard_size`` pairs is written atomically, its keys file last; a re-run skips finished
shards and refuses other settings. Under torchrun (or ``--rank`` / ``--world_size`` from another launcher)
rank r draws shards r, r + N, ...: no rank waits for another. Memory holds one shard's arrays. Exit 0 when
this rank's shards are done, 2 with one line when it cannot run.
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path

from safetensors import SafetensorError

import sd.cli
import sd.distributed
import sd.formats
import sd.reflow
import sd.runtime
import sd.sampling

ERRORS = (KeyError, ValueError, OSError, SafetensorError)


def parse_args(argv=None):
    parser = sd.cli.ArgumentParser(description=__doc__, formatter_class=sd.cli.HelpFormatter)
    parser.add_argument("--ckpt", required=True, help="a flow model (prediction_type: flow, or trained with "
                        "flow_matching: true): our run or checkpoint folder, a diffusers folder or hub id, or a single file")
    parser.add_argument("--prompts", required=True, help="prompts: a text file (one per line) or a .tsv/.csv with "
                        "a caption column")
    parser.add_argument("--out", required=True, help="output folder (latents/ and captions/ under it)")
    parser.add_argument("--n", type=int, default=None, help="pairs to draw (default: one per prompt)")
    parser.add_argument("--sampler", choices=sd.sampling.FLOW_SAMPLERS, default="flow_euler",
                        help="the ODE solver (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=25, help="solver steps (default: %(default)s)")
    parser.add_argument("--cfg", type=float, default=3.0, help="classifier-free guidance scale of the pairs: the "
                        "reflowed model learns the guided paths (default: %(default)s)")
    parser.add_argument("--negative", default="", help="negative prompt (default: empty)")
    parser.add_argument("--seed", type=int, default=0, help="pair i's seed is seed + i (default: %(default)s)")
    parser.add_argument("--flow_shift", type=float, default=None, help="the solver's time shift (default: what the "
                        "model records)")
    parser.add_argument("--height", type=int, default=None, help="pixels, a multiple of 8 (default: the size the "
                        "model was trained at)")
    parser.add_argument("--width", type=int, default=None, help="pixels, a multiple of 8 (default: as --height)")
    parser.add_argument("--shard_size", type=int, default=1000, help="pairs per shard (default: %(default)s)")
    parser.add_argument("--batch_size", type=int, default=16, help="pairs per UNet call (default: %(default)s)")
    parser.add_bool("--no_ema", help="draw with the live weights of our checkpoints, not the EMA")
    parser.add_argument("--device", default="auto", help="auto (this rank's GPU, else CPU), cpu, cuda")
    parser.add_argument("--precision", choices=("auto", *sd.runtime.PRECISIONS), default="auto",
                        help="model precision; auto = bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--rank", type=int, default=None, help="this worker's rank without torchrun (a SLURM array)")
    parser.add_argument("--world_size", type=int, default=None, help="the workers' count without torchrun")
    args = parser.parse_args(argv)
    for name in ("n", "steps", "shard_size", "batch_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be >= 1, got {value}")
    if any(side is not None and (side % 8 or side <= 0) for side in (args.height, args.width)):
        parser.error("--height and --width must be positive multiples of 8")
    problem = sd.sampling.settings_error(args.sampler, args.steps, args.cfg)
    if problem:
        parser.error(f"--sampler {args.sampler}, --steps {args.steps}, --cfg {args.cfg:g}: {problem}")
    if args.flow_shift is not None and not 0 < args.flow_shift < float("inf"):
        parser.error(f"--flow_shift must be a positive number, got {args.flow_shift}")
    if (args.rank is None) != (args.world_size is None) or (args.rank is not None
                                                             and not 0 <= args.rank < args.world_size):
        parser.error("--rank and --world_size go together, with 0 <= rank < world_size")
    return args


def settings_of(args) -> sd.reflow.Settings:
    """The request, its defaults from the model (the shift and the size) left for ``sd.reflow.draw``."""
    import sd.evaluation

    prompts = sd.evaluation.read_prompts(args.prompts)
    return sd.reflow.Settings(ckpt=args.ckpt, prompts=str(Path(args.prompts).resolve()), n=args.n or len(prompts),
                              sampler=args.sampler, steps=args.steps, cfg=args.cfg, negative=args.negative,
                              seed=args.seed, flow_shift=args.flow_shift or 0.0, height=args.height or args.width or 0,
                              width=args.width or args.height or 0, shard_size=args.shard_size, no_ema=args.no_ema)


def main(argv=None) -> int:
    sd.runtime.start_process()
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    try:
        settings = settings_of(args)
        d = sd.distributed.independent(args.device, args.rank, args.world_size)
        meta = sd.reflow.draw(settings, Path(args.out), args.batch_size, d, args.precision)
    except ERRORS as error:
        print(f"SD_Reflow.py: {sd.cli.first_line(error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"SD_Reflow.py: interrupted (Ctrl-C); the finished shards are kept in {args.out} (a shard under way "
              "is written whole or not at all): re-run the same command to draw the rest", file=sys.stderr)
        return 128 + signal.SIGINT
    print(sd.reflow.summary(meta, Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
