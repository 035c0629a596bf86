"""Benchmark: the fixed per-step cost of sd.train.step.train_step against the step of an earlier revision.

    python bench/step_overhead.py                          # CPU: tiny and demo UNets, 64 px, batch 4
    python bench/step_overhead.py --unets tiny --configs fp32,bf16 --windows 3 --old_rev 51efd86

What a GPU step costs beyond its arithmetic is the host's: one kernel launch per operator, and every
place the host waits for the device (a read of a tensor's value). Both are counted here on the CPU,
where they can be counted exactly and without a GPU, as a proxy for that cost:

* ``ops/step``: the ATen operators dispatched per optimizer step, counted with a ``TorchDispatchMode``
  (below autograd, so forward and backward; an operator's own inner calls are not seen, so each
  count is one call to a backend kernel), views and bare allocations left out (``view``, ``t``,
  ``expand``, ``detach``, ``empty``...: no kernel runs for them on a GPU). The profiler's
  ``key_averages()`` was not used: it lists composite operators and the ones they call inside
  (``aten::linear`` and its ``aten::addmm``), so its totals count one launch several times.
  The CPU has no foreach kernels for ``clip_grad_norm_`` (torch falls back to one ``norm`` and one
  ``mul_`` per gradient), so the totals are higher than a GPU's; both revisions clip alike, and the
  difference between them is what the column shows.
* ``syncs/step``: reads of a tensor's value by the host (``item()``, ``bool()``, ``float()``:
  ``aten._local_scalar_dense`` in the same mode; ``tolist()`` and ``numpy()``, which read a CPU
  tensor's memory without dispatching, through a wrapper of those two methods), over a window of
  ``--steps`` steps that ends with the read the training loop makes at its logging points
  (``read_results`` where the revision has it), divided by the steps. On a CPU every tensor is on
  the device, so a read of any tensor counts; the places are listed with ``--sites``.
* ``images/s``: the median window of ``--windows`` timed windows after ``--warmup`` steps, both
  revisions alternating (``--repeats`` pairs of runs, the order swapped each time). On a CPU the
  device does not run ahead of the host, so a removed sync saves no time here: this column shows
  that the new bookkeeping costs nothing, not what it saves on a GPU.

Ours is the working tree's ``sd`` package; the peer is the ``sd`` package of ``--old_rev``
(51efd86: ``train_step`` returned Python floats read with one ``tolist()`` at every step, and took
the skip decision on the host), taken out with ``git archive`` into a temporary folder. Each side
runs in a process of its own with ``PYTHONPATH`` naming its tree first (the ``sd`` it imported is
checked); both build the step as bench/train_throughput.py does (``sd.train.step.build_step`` on
seeded random weights, synthetic fp16 latents and token ids, fused AdamW, CLIP text encoder forward)
with the same seed, so their losses agree, which is printed. Configurations (``--configs``):
``fp32``, ``bf16`` (autocast), ``+accum2`` (two micro-batches a step), ``-ema`` (no EMA; otherwise an
EMA on the training device). Prints a table, the ratio new / old of images/s, and one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path

from bench import harness

CONFIGS = ("fp32", "bf16", "fp32+accum2", "bf16+accum2", "fp32-ema")
# Operators that launch no kernel on a GPU besides the views: bare allocations.
ALLOCATIONS = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}


def parse_config(name: str) -> dict:
    """``fp32``, ``bf16``, with ``+accum2`` (or any ``+accumN``) and/or ``-ema``."""
    precision, *rest = name.replace("-ema", "+noema").split("+")
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"--configs: {name!r} must start with fp32 or bf16")
    grad_accum, ema = 1, True
    for part in rest:
        if part.startswith("accum") and part[5:].isdigit():
            grad_accum = int(part[5:])
        elif part == "noema":
            ema = False
        else:
            raise ValueError(f"--configs: {name!r}: unknown part {part!r} (use +accumN and/or -ema)")
    return {"precision": precision, "grad_accum": grad_accum, "ema": ema}


# ---------------------------------------------------------------------------------------------
# One side, in its own process
# ---------------------------------------------------------------------------------------------


def counting_mode(tree: Path):
    """A dispatch mode counting operators and host reads; ``uninstall()`` puts tolist/numpy back."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    def site() -> str:
        for frame in reversed(traceback.extract_stack()[:-2]):
            path = Path(frame.filename)
            if tree in path.parents and "bench" not in path.parts[-2:]:
                return f"{path.relative_to(tree)}:{frame.lineno} {frame.line}"
        return "outside the sd package"

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops, self.syncs = collections.Counter(), collections.Counter()
            self.wrapped = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}
            for name, method in self.wrapped.items():
                setattr(torch.Tensor, name, self.reader(name, method))

        def reader(self, name, method):
            def read(tensor, *args, **kwargs):
                self.syncs[f"{name}(): {site()}"] += 1
                return method(tensor, *args, **kwargs)
            return read

        def uninstall(self):
            for name, method in self.wrapped.items():
                setattr(torch.Tensor, name, method)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if func is torch.ops.aten._local_scalar_dense.default:
                self.syncs[f"item(): {site()}"] += 1
            if not func.is_view and name not in ALLOCATIONS:
                self.ops[name] += 1
            return func(*args, **(kwargs or {}))

    return Count()


def measure_config(unet_preset: str, config_name: str, args, tree: Path) -> dict:
    import torch

    import sd.model
    import sd.train.step
    from sd.distributed import Dist
    from sd.train.config import TrainConfig

    settings = parse_config(config_name)
    device = torch.device("cpu")
    config = TrainConfig(unet=unet_preset, grad_accum=settings["grad_accum"], precision=settings["precision"],
                         ema_decay=0.9999 if settings["ema"] else 0.0, ema_device="same", grad_checkpointing=False)
    unet = sd.model.build_unet(config.unet, seed=config.seed).to(device).train()
    step = sd.train.step.build_step(config, Dist.single(device), unet, harness.random_text_encoder("tiny"),
                                   harness.empty_prompt_ids(), sd.model.SD1_SCALING_FACTOR)
    sd.train.step.wrap_model(step, False)
    micro_batches = [harness.synthetic_batch(args.batch, args.resolution // harness.vae_factor("tiny"), seed=i)
                     for i in range(config.grad_accum)]
    read_results = getattr(sd.train.step, "read_results", lambda results: results)  # absent at older revisions
    index = iter(range(10**9))

    def window(steps: int):
        """``steps`` optimizer steps as the loop makes them, then the logging point's read."""
        results = []
        with sd.model.attention_context(device):
            for _ in range(steps):
                i = next(index)
                sd.train.step.set_lr(step.optimizer, sd.train.step.lr_at(i, config.lr, 10, 10**6))
                results.append(sd.train.step.train_step(step, micro_batches, i))
        return [result["loss"] for result in read_results(results)]

    window(args.warmup)
    count = counting_mode(tree)
    try:
        with count:
            losses = window(args.steps)
    finally:
        count.uninstall()
    seconds = []
    for _ in range(args.windows):
        start = time.perf_counter()
        window(args.steps)
        seconds.append(time.perf_counter() - start)
    images = args.batch * config.grad_accum * args.steps
    return {"unet": unet_preset, "config": config_name, "ops_per_step": sum(count.ops.values()) / args.steps,
            "syncs_per_step": sum(count.syncs.values()) / args.steps, "ops": dict(count.ops),
            "sync_sites": dict(count.syncs), "images_per_s": [images / s for s in seconds],
            "losses": losses}


def child(args) -> None:
    import torch

    import sd
    import sd.runtime

    tree = Path(args.tree).resolve()
    if tree not in Path(sd.__file__).resolve().parents:
        raise SystemExit(f"the sd package came from {sd.__file__}, not from {tree}: check PYTHONPATH")
    sd.runtime.start_process(threads=args.threads)
    rows = [measure_config(unet, config, args, tree) for unet in harness.parse_list(args.unets, str)
            for config in harness.parse_list(args.configs, str)]
    print(json.dumps({"sd_file": sd.__file__, "torch": torch.__version__, "rows": rows}))


# ---------------------------------------------------------------------------------------------
# Both sides, alternating
# ---------------------------------------------------------------------------------------------


def export_revision(rev: str, folder: Path) -> Path:
    """The ``sd`` package of ``rev`` under ``folder`` (``git archive REV sd``)."""
    archive = subprocess.run(["git", "-C", str(harness.ROOT), "archive", "--format=tar", rev, "sd"],
                             capture_output=True, check=False)
    if archive.returncode != 0:
        raise SystemExit(f"--old_rev {rev}: git archive failed: {archive.stderr.decode().strip()}")
    tar_path = folder / "sd.tar"
    tar_path.write_bytes(archive.stdout)
    with tarfile.open(tar_path) as tar:
        tar.extractall(folder, filter="data")
    return folder


def run_side(tree: Path, args) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "--tree", str(tree),
               "--unets", args.unets, "--configs", args.configs, "--batch", str(args.batch), "--resolution",
               str(args.resolution), "--warmup", str(args.warmup), "--steps", str(args.steps), "--windows",
               str(args.windows), "--threads", str(args.threads)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(harness.ROOT)])}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    if result.returncode != 0:
        raise RuntimeError(f"{tree}: the measuring process failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def merge(runs: list[dict]) -> list[dict]:
    """One row per (unet, config): counts from the first run (they repeat exactly), every window's rate."""
    rows = [dict(row) for row in runs[0]["rows"]]
    for row, *others in zip(rows, *(run["rows"] for run in runs[1:])):
        for other in others:
            row["images_per_s"] = row["images_per_s"] + other["images_per_s"]
            row["counts_repeat"] = row.get("counts_repeat", True) and (
                other["ops_per_step"], other["syncs_per_step"]) == (row["ops_per_step"], row["syncs_per_step"])
        row["images_per_s"] = statistics.median(row["images_per_s"])
    return rows


def parse_args(argv=None):
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--old_rev", default="51efd86", help="the revision whose sd package is the peer")
    parser.add_argument("--unets", default="tiny,demo", help="UNet presets (sd.model.UNET_PRESETS; the tiny text "
                        "encoder, so a cross-attention width of 64)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="fp32 or bf16, with +accumN and/or -ema")
    parser.add_argument("--batch", type=int, default=4, help="images per micro-batch")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=10, help="steps a window: counted once, then timed "
                        "(the logging interval: one read of the results each window)")
    parser.add_argument("--windows", type=int, default=3, help="timed windows per run")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each side, alternating")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of each side's process")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds one side's process may run")
    parser.add_bool("--sites", help="also print where each side reads values")
    parser.add_bool("--child", help=argparse.SUPPRESS)
    parser.add_argument("--tree", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in harness.parse_list(args.configs, str):
        try:
            parse_config(name)
        except ValueError as error:
            parser.error(str(error))
    if args.resolution % harness.pixel_multiple("tiny"):
        parser.error(f"--resolution must be a multiple of {harness.pixel_multiple('tiny')}")
    return args


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.child:
        child(args)
        return None
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"old": export_revision(args.old_rev, Path(tmp)), "new": harness.ROOT}
        runs = {"old": [], "new": []}
        for repeat in range(args.repeats):
            for side in ("old", "new") if repeat % 2 == 0 else ("new", "old"):
                runs[side].append(run_side(trees[side], args))
    rows = {side: merge(side_runs) for side, side_runs in runs.items()}
    print(f"sd step at {args.old_rev} (old, {runs['old'][0]['sd_file']}) vs the working tree (new, "
          f"{runs['new'][0]['sd_file']}); {args.resolution} px, batch {args.batch}, {args.threads} thread(s), "
          f"CPU, torch {runs['new'][0]['torch']}")
    table = []
    for old, new in zip(rows["old"], rows["new"]):
        table.append({"unet": new["unet"], "config": new["config"],
                      "ops_old": old["ops_per_step"], "ops_new": new["ops_per_step"],
                      "syncs_old": old["syncs_per_step"], "syncs_new": new["syncs_per_step"],
                      "images_per_s_old": old["images_per_s"], "images_per_s_new": new["images_per_s"],
                      "ratio": round(new["images_per_s"] / old["images_per_s"], 3),
                      "losses_equal": old["losses"] == new["losses"],
                      "ops_changed": {op: new["ops"].get(op, 0) - old["ops"].get(op, 0)
                                      for op in sorted(set(old["ops"]) | set(new["ops"]))
                                      if new["ops"].get(op, 0) != old["ops"].get(op, 0)},
                      "sync_sites_old": old["sync_sites"], "sync_sites_new": new["sync_sites"]})
    print_table(table, args.steps)
    if args.sites:
        for row in table:
            print(f"{row['unet']} {row['config']}: reads in {args.steps} steps, old {row['sync_sites_old']}; "
                  f"new {row['sync_sites_new']}")
    result = {"benchmark": "step_overhead", "device": "cpu", "old_rev": args.old_rev, "resolution": args.resolution,
              "batch": args.batch, "steps_per_window": args.steps, "threads": args.threads, "rows": table}
    harness.emit(result, args.json)
    return result


def print_table(table: list[dict], steps: int) -> None:
    heading = ("config", "ops/step old", "ops/step new", "syncs/step old", "new", "images/s old", "new", "ratio")
    print(f"{heading[0]:24}" + "".join(f"{h:>15}" for h in heading[1:]))
    for row in table:
        cells = [f"{row['ops_old']:.0f}", f"{row['ops_new']:.0f}", f"{row['syncs_old']:.2f}", f"{row['syncs_new']:.2f}",
                 f"{row['images_per_s_old']:.1f}", f"{row['images_per_s_new']:.1f}", f"{row['ratio']:.2f}x"]
        print(f"{row['unet'] + ' ' + row['config']:24}" + "".join(f"{c:>15}" for c in cells))
    for row in table:
        changed = ", ".join(f"{op} {n:+.0f}" for op, n in row["ops_changed"].items()) or "none"
        print(f"ratio new/old images/s, {row['unet']} {row['config']} = {row['ratio']:.2f}x; operators per "
              f"{steps} steps new - old: {changed}; losses equal: {row['losses_equal']}")


if __name__ == "__main__":
    main()
