"""Benchmark: training throughput on aspect-ratio buckets vs square latents of the same pixel count.

    python bench/bucket_throughput.py                  # CPU: tiny UNet, 64 px, 16 px bucket steps
    python bench/bucket_throughput.py --arch sd1 --resolution 512 --batch_sizes 8,16 --precision bf16   # GPU
    python bench/bucket_throughput.py --arch sd1 --resolution 512 --batch_sizes 8,16 --precision bf16 --compile

With ``encode_latents.py --buckets`` the trainer draws every micro-batch from one bucket
(``sd.data.training_data.epoch_batches``), so consecutive steps see different latent shapes. What that costs against
square training is measured on ``sd.train.step.train_step`` as ``train_throughput.our_step`` builds it
(the trainer's loss, fused AdamW, the EMA, one micro-batch per optimizer step), same-seeded random
weights, the synthetic fp16 latents and token ids of ``harness.synthetic_batch``. Rows:

* ``square``: every step at ``--resolution`` x ``--resolution``: the peer.
* ``buckets``: step k at the k-th size of a cycle over the sizes w x h with w * h == resolution**2
  exactly, both sides multiples of ``--bucket_step`` and between half and twice the resolution (the
  range of ``sd.data.buckets.default_buckets``): 256x1024, 512x512, 1024x256 at 512 px with 64 px steps;
  32x128, 64x64, 128x32 at 64 px with 16 px steps. The same number of latent cells, hence of attention
  tokens, as the square: the same FLOPs, so its ratio is the cost of the changing shapes alone.
* ``buckets-default``: the cycle over ``sd.data.buckets.default_buckets(resolution, bucket_step)``, the
  list ``encode_latents.py --buckets`` writes by default: sizes of up to resolution**2 pixels, so
  read its megapixels/s (pixels per second is the ratio printed for every row).

Sizes the UNet cannot take (a latent side not divisible by 2 ** (UNet down blocks - 1)) are left out
and named. Each row is its own fresh model. Every distinct shape runs ``--warmup`` times untimed before
any timing, and the first step of each shape is timed on its own (``first_step_s``): that is where a
new shape pays its one-off costs (with ``--compile``, a recompile; the first shape of a row also pays
for the first optimizer step). Then ``--rounds`` rounds of at least ``--steps`` steps, a whole number
of cycles, each step timed alone (the step already ends in one host sync); a shape's step time is the
median of its timed steps, and a row's images/s the batch times its shapes over the sum of their step
times (every shape weighs the same, as over a cycle).

``--compile`` compiles the way the trainer does, ``sd.train.step.wrap_model``: a row of several sizes
with ``dynamic=False`` (one static graph per size, compiled when the size first comes; see
``sd.train.step.compile_options``), the square row with torch's defaults; the ``graphs`` column
counts the graphs compiled per row, and a row whose compile fails is printed with the error while
the run goes on. Compiled rows (and
every row with ``--rounds 1``, the GPU default) are built, timed and freed one at a time, with
dynamo's caches reset between rows: the compile cache belongs to the UNet's ``forward``, shared by
every UNet in the process. Those rows also get their own peak memory (``harness.peak_gb``
after the warm-up: the steady state over all the row's shapes). With more rounds and no compile (the
CPU default) all rows of a batch are built together and their rounds alternate, the order reversed
every other round, so drift on a shared machine hits every row alike (no peak memory then).

Prints a table, one line per shape, the ratios and one JSON line.
"""

from __future__ import annotations

import math
import statistics
import sys

import torch

import sd.data.buckets
import sd.runtime
from bench import harness, train_throughput

# ---------------------------------------------------------------------------------------------
# The bucket cycles
# ---------------------------------------------------------------------------------------------


def equal_pixel_buckets(resolution: int, step: int) -> list[sd.data.buckets.Bucket]:
    """Sizes ``(width, height)`` of exactly ``resolution``**2 pixels, sides multiples of ``step`` from
    half to twice ``resolution``; sorted from the tallest to the widest, as ``default_buckets``."""
    area = resolution * resolution

    def side_ok(side: int) -> bool:
        return side % step == 0 and resolution <= 2 * side <= 4 * resolution

    sizes = [(width, area // width) for width in range(step, 2 * resolution + 1, step)
             if area % width == 0 and side_ok(width) and side_ok(area // width)]
    return sorted(sizes, key=lambda b: b[0] / b[1])


def usable(buckets: list, arch: str) -> tuple[list, list]:
    """``(sizes the arch's UNet takes, sizes it does not)``: both sides multiples of ``pixel_multiple``."""
    multiple = harness.pixel_multiple(arch)
    kept = [b for b in buckets if b[0] % multiple == 0 and b[1] % multiple == 0]
    return kept, [b for b in buckets if b not in kept]


def cycles_of(args) -> dict[str, list]:
    """``{row name: its cycle of sizes}``; prints the sizes left out for the UNet."""
    cycles = {"square": [(args.resolution, args.resolution)],
              "buckets": equal_pixel_buckets(args.resolution, args.bucket_step),
              "buckets-default": sd.data.buckets.default_buckets(args.resolution, args.bucket_step)}
    factor = harness.vae_factor(args.arch)
    for name, sizes in cycles.items():
        kept, dropped = usable(sizes, args.arch)
        if dropped:
            print(f"{name}: left out {', '.join(sd.data.buckets.name(b) for b in dropped)}: the {args.arch} UNet needs "
                  f"latent sides divisible by {harness.pixel_multiple(args.arch) // factor} (pixel sides by "
                  f"{harness.pixel_multiple(args.arch)})")
        cycles[name] = kept
    if len(cycles["buckets"]) == 1:
        print(f"buckets: no size but the square has exactly {args.resolution}x{args.resolution} pixels in "
              f"{args.bucket_step} px steps; the row only repeats the square")
    return cycles


# ---------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------


class Row:
    """One row being measured: its step, one synthetic batch per size, and the times taken."""

    def __init__(self, name: str, sizes: list, batch: int, args, device):
        self.name, self.sizes, self.batch, self.args, self.device = name, sizes, batch, args, device
        factor = harness.vae_factor(args.arch)
        self.batches = [harness.synthetic_batch(batch, (h // factor, w // factor), seed=i)
                        for i, (w, h) in enumerate(sizes)]
        self.first = [0.0] * len(sizes)
        self.times = [[] for _ in sizes]
        self.step = None
        self.graphs = 0

    def build_and_warm(self) -> None:
        """Build the step, then run every size ``--warmup`` times untimed; the first of each timed."""
        graphs = compiled_graphs()
        variant = train_throughput.Variant(self.args.compile, self.args.channels_last, self.args.checkpointing)
        self.step = train_throughput.our_step(self.args.arch, variant, self.device, self.args.precision,
                                              len(self.sizes))
        try:
            for cycle in range(self.args.warmup):
                for i, (latents, input_ids) in enumerate(self.batches):
                    seconds = harness.time_steps(lambda: self.step(latents, input_ids), self.device, 0, 1)
                    if cycle == 0:
                        self.first[i] = seconds
        finally:
            self.graphs = compiled_graphs() - graphs

    def time_round(self) -> None:
        """Whole cycles over the sizes, at least ``--steps`` steps, each step timed alone."""
        for _ in range(math.ceil(self.args.steps / len(self.sizes))):
            for i, (latents, input_ids) in enumerate(self.batches):
                self.times[i].append(harness.time_steps(lambda: self.step(latents, input_ids), self.device, 0, 1))

    def result(self) -> dict:
        factor = harness.vae_factor(self.args.arch)
        shapes = [{"size": sd.data.buckets.name(size), "latent": f"{size[0] // factor}x{size[1] // factor}",
                   "pixels": size[0] * size[1], "first_step_s": round(first, 4),
                   "step_ms": 1000 * statistics.median(times) if times else None}
                  for size, first, times in zip(self.sizes, self.first, self.times)]
        row = {"variant": self.name, "batch": self.batch, "shapes": shapes, "sizes": len(self.sizes),
               "mean_pixels": statistics.mean(s["pixels"] for s in shapes),
               "first_step_s": round(sum(self.first), 4), "graphs": self.graphs if self.args.compile else None}
        if all(times for times in self.times):
            cycle_s = sum(s["step_ms"] for s in shapes) / 1000
            row.update(step_ms=1000 * cycle_s / len(shapes), images_per_s=self.batch * len(shapes) / cycle_s,
                       megapixels_per_s=self.batch * sum(s["pixels"] for s in shapes) / cycle_s / 1e6)
        return row


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (never reset by ``torch._dynamo.reset``)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def measure(cycles: dict, batch: int, device, args) -> list[dict]:
    """Every row at ``batch``: one at a time with ``--rounds 1`` or ``--compile``, else built together and
    timed in alternating rounds."""
    rows = [Row(name, sizes, batch, args, device) for name, sizes in cycles.items()]
    one_at_a_time = args.rounds == 1 or args.compile
    results = {}
    for row in rows:
        try:
            row.build_and_warm()
            if one_at_a_time:
                harness.reset_peak(device)
                for _ in range(args.rounds):
                    row.time_round()
                results[row.name] = {**row.result(), **harness.peak_gb(device)}
        except harness.out_of_memory_errors():
            results[row.name] = {**row.result(), "oom": True}
        except Exception as error:  # a shape change the compiler cannot handle is a result, not the end of the run
            if not args.compile:
                raise
            results[row.name] = {**row.result(), "error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
        if row.name in results:
            row.step = None
            harness.release(device)
            progress(results[row.name])
    live = [row for row in rows if row.name not in results]
    for i in range(args.rounds if live else 0):
        for row in live if i % 2 == 0 else reversed(live):  # no row always first or last
            row.time_round()
    for row in live:
        results[row.name] = row.result()
        progress(results[row.name])
    del rows, live
    harness.release(device)
    return [results[name] for name in cycles]


def progress(row: dict) -> None:
    """A line on stderr as each row ends (a compiled run on a GPU takes minutes a row)."""
    if row.get("oom") or row.get("error"):
        outcome = row.get("error") or "out of memory"
    else:
        outcome = f"{row['images_per_s']:.2f} images/s, first steps {row['first_step_s']:.2f} s"
    print(f"{row['variant']} at batch {row['batch']}: {outcome}", file=sys.stderr, flush=True)


def add_ratios(rows: list[dict]) -> list[dict]:
    """Each row's pixels/s (and images/s) over the square row's at the same batch."""
    out = []
    for row in rows:
        square = next((r for r in rows if r["variant"] == "square" and r["batch"] == row["batch"]), {})
        if row.get("megapixels_per_s") and square.get("megapixels_per_s"):
            row["pixels_ratio"] = round(row["megapixels_per_s"] / square["megapixels_per_s"], 3)
            row["images_ratio"] = round(row["images_per_s"] / square["images_per_s"], 3)
            if row["variant"] != "square":
                out.append({"batch": row["batch"], "variant": row["variant"], "pixels_per_s": row["pixels_ratio"],
                            "images_per_s": row["images_ratio"]})
    return out


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--batch_sizes", default="8,16" if cuda else "4", help="comma-separated per-GPU batches")
    parser.add_argument("--bucket_step", type=int, default=None, help="bucket sides are multiples of this "
                        "(default: what the arch's UNet needs, 64 px for sd1 and 16 px for tiny)")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16" if cuda else "fp32",
                        help="bf16 autocast (GPU default) or fp32 (CPU default)")
    parser.add_bool("--compile", help="compile the UNet as the trainer does (sd.train.step.wrap_model)")
    parser.add_bool("--checkpointing", help="gradient checkpointing")
    parser.add_bool("--channels_last", help="channels-last memory format")
    parser.add_argument("--warmup", type=int, default=2 if cuda else 1, help="untimed steps of each size, before any "
                        "timing (the first of each is timed alone: first_step_s)")
    parser.add_argument("--steps", type=int, default=24 if cuda else 9, help="timed steps per row and round, "
                        "rounded up to whole cycles over the row's sizes")
    parser.add_alias("--timed_steps", "steps", type=int)
    parser.add_argument("--rounds", type=int, default=1 if cuda else 5, help="1: each row built, timed and freed "
                        "in turn, with its peak memory; more: the rows of a batch built together and timed in "
                        "alternating rounds (steadier on a shared CPU; not with --compile)")
    parser.add_argument("--threads", type=int, default=0 if cuda else 1, help="CPU threads of this process; 0 = "
                        "torch's choice (default: 1 without a GPU, as bench/lora_step.py)")
    args = parser.parse_args(argv)
    multiple = harness.pixel_multiple(args.arch)
    args.bucket_step = args.bucket_step or multiple
    if args.resolution % multiple:
        parser.error(f"--resolution must be a multiple of {multiple} for the {args.arch} UNet")
    if args.bucket_step < 8 or args.bucket_step % 8:
        parser.error("--bucket_step must be a positive multiple of 8 (one latent cell)")
    for name in ("warmup", "steps", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1 (every shape runs before timing)")
    return args


def print_results(rows: list[dict], compared: list[dict]) -> None:
    harness.print_table(rows, lambda row: row["variant"],
                        [("batch", "batch", "d"), ("sizes", "sizes", "d"), ("images_per_s", "images/s", ".2f"),
                         ("megapixels_per_s", "Mpx/s", ".3f"), ("pixels_ratio", "px/s ratio", ".3f"),
                         ("step_ms", "step ms", ".1f"), ("first_step_s", "first s", ".3f"),
                         ("graphs", "graphs", "d"), ("peak_allocated_gb", "peak GiB", ".2f"),
                         ("peak_reserved_gb", "reserved", ".2f")])
    print()
    shapes = [{"label": f"{row['variant']} b{row['batch']} {s['size']} ({s['latent']})", **s}
              for row in rows for s in row["shapes"]]
    harness.print_table(shapes, lambda s: s["label"], [("step_ms", "step ms", ".1f"),
                                                       ("first_step_s", "first s", ".3f")])
    for r in compared:
        print(f"ratio {r['variant']}/square at batch {r['batch']}: pixels/s {r['pixels_per_s']:.3f}x, "
              f"images/s {r['images_per_s']:.3f}x")


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = sd.runtime.pick_device(args.device)
    sd.runtime.start_process(threads=args.threads or None)
    cycles = cycles_of(args)
    print(f"{args.arch} UNet, {args.resolution} px, {args.precision}, {harness.device_name(device)}, "
          f"{torch.get_num_threads()} threads" + ", compiled" * args.compile + ", checkpointing" * args.checkpointing
          + ", channels_last" * args.channels_last + "; cycles: "
          + "; ".join(f"{name} {','.join(sd.data.buckets.name(b) for b in sizes)}" for name, sizes in cycles.items()))
    rows = []
    for batch in harness.parse_list(args.batch_sizes):
        rows += measure(cycles, batch, device, args)
    compared = add_ratios(rows)
    print_results(rows, compared)
    result = {"benchmark": "bucket_throughput", "device": harness.device_name(device), "arch": args.arch,
              "resolution": args.resolution, "bucket_step": args.bucket_step, "precision": args.precision,
              "compile": args.compile, "checkpointing": args.checkpointing, "channels_last": args.channels_last,
              "torch": torch.__version__, "threads": torch.get_num_threads(),
              "cycles": {name: [sd.data.buckets.name(b) for b in sizes] for name, sizes in cycles.items()},
              "rows": rows, "ratios": compared}
    harness.emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
