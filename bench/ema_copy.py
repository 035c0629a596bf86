"""Benchmark: the host-side cost of a CPU EMA update, staging buffers vs a fresh copy per update.

    python bench/ema_copy.py                      # CPU: the SD 1.x UNet's tensors cut to a quarter, scaled up
    python bench/ema_copy.py --fraction 1         # the whole 859,520,964 parameters (about 14 GB of RAM)
    python bench/ema_copy.py --device cuda        # GPU weights, CPU shadow: the transfer is in the timing

An EMA kept in CPU memory (``ema_device: cpu``) takes the live fp32 weights off their device at
every update and lerps them into the shadow. Ours (``sd.train.ema.copy_weights``): non-blocking copies into
buffers allocated once (pinned when the weights are on CUDA), a wait on an event after them, then the
lerp. The previous code: ``.to("cpu", non_blocking=True)`` into fresh pageable tensors every update,
then the lerp (on CUDA it did not wait: the lerp could read unfinished copies). Both run on the same
tensors, shaped like the SD 1.x UNet's parameters (each cut to ``fraction`` of its first dimension), in
alternating rounds; the median round counts. Times are scaled to the full parameter count. Prints
both, the ratio ours / previous, the PCIe transfer time computed (not measured) for the full model,
and one JSON line.
"""

from __future__ import annotations

import statistics
import time

import torch

import sd.cli
import sd.model
import sd.runtime
import sd.train.ema
from bench import harness

PCIE_GB_PER_S = {"PCIe 4.0 x16": 25.0, "PCIe 5.0 x16": 50.0}  # typical pinned-memory rates, one direction


def parameter_shapes(arch: str) -> list[torch.Size]:
    with torch.device("meta"):
        return [p.shape for p in sd.model.build_unet(harness.unet_preset(arch)).parameters()]


def ours(shadow, buffers, live, weight: float) -> None:
    sd.train.ema.copy_weights(buffers, live)
    torch._foreach_lerp_(shadow, buffers, weight)


def previous(shadow, live, weight: float) -> None:
    copies = [p.to("cpu", dtype=torch.float32, non_blocking=True, copy=True) for p in live]
    torch._foreach_lerp_(shadow, copies, weight)


def measure(args) -> dict:
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    all_shapes = parameter_shapes(args.arch)
    shapes = [torch.Size([max(1, round(s[0] * args.fraction)), *s[1:]]) for s in all_shapes]  # every tensor, cut
    used, total = sum(s.numel() for s in shapes), sum(s.numel() for s in all_shapes)
    live = [torch.full(s, 0.5, device=device) for s in shapes]
    shadow = [torch.ones(s) for s in shapes]
    buffers = [torch.empty(s, pin_memory=device.type == "cuda") for s in shapes]
    paths = {"ours": lambda: ours(shadow, buffers, live, 1e-4), "previous": lambda: previous(shadow, live, 1e-4)}
    times = {name: [] for name in paths}
    for round_ in range(args.rounds + 1):  # round 0 warms up (first touch of the buffers)
        for name, update in paths.items():
            sd.runtime.synchronize(device)
            start = time.perf_counter()
            update()
            sd.runtime.synchronize(device)
            if round_:
                times[name].append(time.perf_counter() - start)
    scale = total / used
    result = {"device": harness.device_name(device), "arch": args.arch, "params_measured": used, "params_full": total,
              "bytes_full": total * 4, "rounds": args.rounds}
    for name in paths:
        result[f"{name}_s"] = round(statistics.median(times[name]), 6)
        result[f"{name}_s_full"] = round(statistics.median(times[name]) * scale, 4)
    result["ratio_ours_vs_previous"] = round(statistics.median(times["ours"]) / statistics.median(times["previous"]), 3)
    result["pcie_s_computed"] = {link: round(total * 4 / (rate * 1e9), 3) for link, rate in PCIE_GB_PER_S.items()}
    return result


def report(result: dict) -> None:
    gb = result["bytes_full"] / 1e9
    print(f"{result['device']}, {result['arch']}: {result['params_measured']:,} of {result['params_full']:,} fp32 "
          f"parameters measured, median of {result['rounds']} rounds, scaled to the full {gb:.2f} GB")
    for name, what in (("ours", "staging buffers + lerp"), ("previous", "fresh copy per update + lerp")):
        print(f"  {name:9} {what:30} {result[f'{name}_s'] * 1000:9.1f} ms measured  "
              f"{result[f'{name}_s_full']:7.3f} s per update at full size")
    print(f"  ratio ours/previous = {result['ratio_ours_vs_previous']:.2f}x")
    for link, seconds in result["pcie_s_computed"].items():
        print(f"  computed, not measured: {gb:.2f} GB over {link} at {PCIE_GB_PER_S[link]:.0f} GB/s = {seconds:.3f} s")


def main(argv=None) -> dict:
    parser = sd.cli.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", choices=["sd1", "tiny"], default="sd1", help="whose parameter shapes (default: sd1)")
    parser.add_argument("--device", default="auto", help="where the live weights are: auto, cpu or cuda")
    parser.add_argument("--json", default="", help="also write the result JSON to this file")
    parser.add_argument("--fraction", type=float, default=None,
                        help="share of each parameter tensor to measure (default: 1 on a GPU, 0.25 on a CPU)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds of each path (default: 5)")
    args = parser.parse_args(argv)
    if args.fraction is None:
        args.fraction = 1.0 if torch.cuda.is_available() else 0.25
    if not 0 < args.fraction <= 1:
        parser.error("--fraction must be in (0, 1]")
    result = measure(args)
    report(result)
    harness.emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
