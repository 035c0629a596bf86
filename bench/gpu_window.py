"""The headline GPU table from one borrowed GPU in at most 7 minutes: what bench/gpu_window.sh runs.

    OUT=DIR bash bench/gpu_window.sh             # on the GPU machine (the wheel folder .whl carried)
    OUT=DIR bash bench/gpu_window.sh --dry_run   # the same pieces at tiny sizes on the CPU
    python bench/gpu_window.py estimates         # before a window, on a CPU: the memory estimates it carries

Each piece is a bench script run in a process of its own under its own time cap (and what is left of
``--budget``), so a hang or a crash costs that piece alone; at 512 px, bf16, one GPU:

1. the training step, eager, batch 16 and 32, beside diffusers' ``train_text_to_image.py`` step on the
   same batch (bench/train_throughput.py: images/s, MFU, peak allocated and reserved memory);
2. host syncs and dispatched operators per optimizer step (bench/host_syncs.py, under
   ``torch.cuda.set_sync_debug_mode``);
3. 50-step DDIM sampling images/s beside diffusers' pipeline (bench/sampling.py);
4. latent encoding images/s of encode_latents.py beside the naive loop (bench/encode_throughput.py);
5. the training step compiled, batch 16 and 32 (each shape compiles, a minute or two).

The peaks are set beside ``sd.train.memory``'s estimates for the same settings, computed on a CPU
beforehand (``estimates``, written to bench/gpu_window_estimates.json) so the GPU never waits for them.
Writes ``OUT/gpu_window.md`` (a dated table, each row naming device, torch, settings and command) and
``OUT/gpu_window.json``; each piece's log and JSON stay in ``OUT/pieces``. With ``--dry_run`` every piece
runs on the CPU at the tiny presets (the compiled step through the ``aot_eager`` backend, which captures
the graphs without generating kernels), so the command is proven before a window is spent on it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import runpy
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import sd.files

ROOT = Path(__file__).resolve().parents[1]
ESTIMATES = ROOT / "bench" / "gpu_window_estimates.json"
# all pieces together: with the wheels' install and the table, the window's command ends within 7 minutes
BUDGET_S = 400
# A dry run proves the plumbing, not the speed: no overall budget, and each piece's cap (which catches a hang)
# this many times the window's, so a busy CPU slows it without failing it.
DRY_CAP_SCALE = 5
PRELOAD_MODULES = ("bench.harness", "sd.model", "sd.train.step", "sd.train.memory", "sd.sampling",
                   "diffusers.models.unets.unet_2d_condition", "diffusers.models.autoencoders.autoencoder_kl",
                   "diffusers.schedulers", "diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion",
                   "transformers.models.clip.modeling_clip")


@dataclass(frozen=True)
class Sizes:
    """What the pieces measure: the GPU's sizes, or the tiny ones of a dry run."""
    arch: str
    resolution: int
    batches: tuple
    precision: str
    warmup: int
    timed_steps: int
    sampling_batch: int
    sampling_steps: int
    encode_args: tuple
    compile_backend: str = "inductor"
    peak_tflops: tuple = ()  # e.g. ("--peak_tflops", "1") so the dry run fills the MFU column


GPU = Sizes(arch="sd1", resolution=512, batches=(16, 32), precision="bf16", warmup=3, timed_steps=10,
            sampling_batch=4, sampling_steps=50,
            encode_args=("--vae", "sd1", "--resolution", "512", "--images", "512", "--per_shard", "128",
                         "--batch_size", "64", "--workers", "16"))
DRY = Sizes(arch="tiny", resolution=64, batches=(2, 4), precision="fp32", warmup=1, timed_steps=1,
            sampling_batch=1, sampling_steps=2,
            encode_args=("--vae", "tiny", "--resolution", "64", "--images", "16", "--per_shard", "8",
                         "--batch_size", "8", "--workers", "2"),
            compile_backend="aot_eager", peak_tflops=("--peak_tflops", "1"))


@dataclass
class Piece:
    name: str
    title: str
    cap_s: int
    script: str
    args: list
    part: str = "headline"
    writes_json: bool = True  # a bench script's --json; else a module (pytest), its last line read
    result: dict | None = None
    ended: str = "not run"
    seconds: float = 0.0
    last_line: str = ""

    @property
    def command(self) -> str:
        run = self.script if self.script.endswith(".py") else f"-m {self.script}"
        return " ".join(["python", run, *(arg if arg else '""' for arg in self.args)])


def pieces(s: Sizes) -> list[Piece]:
    common = ["--device", "cpu" if s is DRY else "cuda", "--arch", s.arch, "--resolution", str(s.resolution)]
    steps = ["--warmup", str(s.warmup), "--timed_steps", str(s.timed_steps), "--rounds", "1"]
    train = [*common, "--precision", s.precision, "--channels_last", "0", "--checkpointing", "0", *steps,
             *s.peak_tflops]
    out = [Piece(f"train_eager_{batch}", f"training step, eager, batch {batch}", 150, "bench/train_throughput.py",
                 [*train, "--batch_sizes", str(batch), "--variants", "eager", "--peers", "unet"])
           for batch in s.batches]
    out.append(Piece("host_syncs", "host syncs per optimizer step", 90, "bench/host_syncs.py",
                     [*common, "--precision", s.precision, "--batch", str(s.batches[0]), "--warmup", "3",
                      "--steps", "5"]))
    out.append(Piece("sampling", f"{s.sampling_steps}-step DDIM sampling", 90, "bench/sampling.py",
                     [*common, "--batch_sizes", str(s.sampling_batch), "--steps", str(s.sampling_steps),
                      "--repeats", "2", "--modes", "eager"]))
    out.append(Piece("encode", "latent encoding", 90, "bench/encode_throughput.py",
                     ["--device", common[1], *s.encode_args]))
    out += [Piece(f"train_compiled_{batch}", f"training step, compiled, batch {batch}", 240,
                  "bench/train_throughput.py",
                  [*train, "--batch_sizes", str(batch), "--variants", "compile", "--peers", "",
                   "--compile_backend", s.compile_backend])
            for batch in s.batches]
    # the levers of the record's step, side by side at the first batch (a second command: --part levers)
    batch = str(s.batches[0])
    out.append(Piece("lever_attention", f"training step, eager, attention auto vs cudnn, batch {batch}", 120,
                     "bench/train_throughput.py", [*train, "--batch_sizes", batch, "--variants", "eager",
                                                   "--attention", "auto,cudnn", "--peers", ""], part="levers"))
    bf16 = [*train[:train.index("--precision")], "--precision", "bf16", *train[train.index("--precision") + 2:]]
    out.append(Piece("lever_bf16_weights", f"training step, eager, bf16 autocast of fp32 weights vs bf16_weights, "
                     f"batch {batch}", 120, "bench/train_throughput.py",
                     [*bf16, "--batch_sizes", batch, "--variants", "eager", "--bf16_weights", "0,1", "--peers", ""],
                     part="levers"))
    out.append(Piece("lever_channels_last", f"training step, compiled, channels_last, batch {batch}", 240,
                     "bench/train_throughput.py",
                     [*train[:train.index("--channels_last")], "--channels_last", "1",
                      *train[train.index("--channels_last") + 2:], "--batch_sizes", batch, "--variants", "compile",
                      "--peers", "", "--compile_backend", s.compile_backend], part="levers"))
    out.append(Piece("lever_cuda_graphs", f"training step, compiled with CUDA graphs (reduce-overhead), batch {batch}",
                     240, "bench/train_throughput.py",
                     [*train, "--batch_sizes", batch, "--variants", "compile", "--compile_modes", "reduce-overhead",
                      "--peers", "", "--compile_backend", s.compile_backend], part="levers"))
    out.append(Piece("gpu_tests", "pytest -m gpu (the CUDA-only checks)", 240, "pytest", [
        "-m", "gpu", "tests/gpu", "-p", "no:xdist", "-p", "no:cacheprovider", "-o", "addopts=", "-q"],
        part="levers", writes_json=False))
    return out


# ---------------------------------------------------------------------------------------------
# Running the pieces
# ---------------------------------------------------------------------------------------------


def run_piece(piece: Piece, folder: Path, cap_s: float, python: list[str]) -> None:
    """The piece in a process group of its own, killed at ``cap_s``; its JSON read back if it wrote one.
    ``python``: how a script starts (an interpreter, or bench/preload.py's client)."""
    result_file, log = folder / f"{piece.name}.json", folder / f"{piece.name}.log"
    argv = [*python, str(Path(__file__)), "run", str(folder / f"{piece.name}.imports"), piece.script, *piece.args,
            *(["--json", str(result_file)] if piece.writes_json else [])]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    print(f"[gpu_window] {piece.title} (at most {cap_s:.0f} s): {piece.command}", flush=True)
    started = time.monotonic()
    with open(log, "w") as out:
        process = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
        try:
            rc = process.wait(timeout=cap_s)
        except subprocess.TimeoutExpired:
            rc = None
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
                try:
                    os.killpg(process.pid, sig)
                    process.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
                except ProcessLookupError:
                    break
    piece.seconds = round(time.monotonic() - started, 1)
    piece.ended = "ok" if rc == 0 else f"timed out at {cap_s:.0f} s" if rc is None else f"failed ({rc})"
    if result_file.exists():
        piece.result = json.loads(result_file.read_text())
    lines = log.read_text(errors="replace").strip().splitlines()
    piece.last_line = lines[-1].strip() if lines else ""
    if rc != 0:
        print(f"[gpu_window] {piece.name}: {piece.ended}: " + " | ".join(lines[-3:]), flush=True)


def run_script(imports: str, script: str, argv: list[str]) -> None:
    """Run a bench script (or a module: ``pytest``) as ``__main__``, then write to the file ``imports`` the
    third-party modules the project's code imported: those its files import at load (``module_level_imports``)
    and those its functions imported as they ran (how the tests check the GPU machine has them all)."""
    import builtins

    executed, original = set(), builtins.__import__

    def recording(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and globals and in_project(globals.get("__file__")):
            executed.add(name.split(".")[0])
        return original(name, globals, locals, fromlist, level)

    sys.argv = [script, *argv]
    builtins.__import__ = recording
    try:
        if script.endswith(".py"):
            runpy.run_path(str(ROOT / script), run_name="__main__")
        else:  # a module, as python -m runs it
            runpy.run_module(script, run_name="__main__", alter_sys=True)
    finally:
        builtins.__import__ = original
        files = {Path(module.__file__) for module in list(sys.modules.values())
                 if in_project(getattr(module, "__file__", None))}
        if script.endswith(".py"):
            files.add(ROOT / script)
        names = (executed | set().union(*(module_level_imports(path) for path in files))) - {"sd", "bench"}
        Path(imports).write_text("\n".join(sorted(n for n in names if n not in sys.stdlib_module_names)) + "\n")


def in_project(path) -> bool:
    """A file of this repository (not of an environment inside it)."""
    if not path:
        return False
    path = Path(path).resolve()
    return ROOT in path.parents and not {".venv", "site-packages"} & set(path.relative_to(ROOT).parts)


def module_level_imports(path: Path) -> set[str]:
    """Top-level names of the absolute imports a module makes whenever it loads (outside functions)."""
    import ast

    names = set()

    def visit(nodes):
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
            visit(ast.iter_child_nodes(node))

    if path.suffix == ".py" and path.exists():
        visit(ast.parse(path.read_text()).body)
    return names


def package_list(name: str) -> dict[str, str]:
    """A list of Python distributions in bench/ (``NAME`` or ``NAME==VERSION`` a line, ``#`` comments):
    gpu_machine.txt, what the GPU machine has; gpu_wheels.txt, what bench/prepare_gpu_wheels.sh downloads
    for it. Returns normalised name -> version ('' where unknown)."""
    out = {}
    for line in (ROOT / "bench" / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            package, _, version = line.partition("==")
            out[normalise(package)] = version.strip()
    return out


def normalise(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(".", "-")


@contextlib.contextmanager
def preloaded(folder: Path):
    """How the dry run starts its pieces: in children of one interpreter that imported torch, diffusers and
    transformers once (bench/preload.py; at the tiny sizes the imports are most of a piece's time). Yields the
    command prefix; an interpreter of its own per piece if the server does not start."""
    socket_path = folder / "preload.sock"
    socket_path.unlink(missing_ok=True)
    log = open(folder / "preload.log", "w")
    server = subprocess.Popen([sys.executable, str(ROOT / "bench" / "preload.py"), "serve", str(socket_path),
                               *PRELOAD_MODULES], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not socket_path.exists() and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if socket_path.exists():
            yield [sys.executable, str(ROOT / "bench" / "preload.py"), "run", str(socket_path)]
        else:
            print(f"[gpu_window] bench/preload.py did not start (see {log.name}); each piece imports on its own",
                  flush=True)
            yield [sys.executable]
    finally:
        server.terminate()
        server.wait()
        log.close()
        socket_path.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------


def estimate_key(arch: str, resolution: int, precision: str, batch: int) -> str:
    return f"{arch}/{resolution}px/{precision}/batch{batch}"


def compute_estimates(s: Sizes) -> dict:
    """``sd.train.memory``'s estimate of the eager step of each batch the window measures (on any CPU)."""
    import sd.train.memory
    from bench.train_throughput import Variant, step_config

    out = {}
    for batch in s.batches:
        config = step_config(s.arch, Variant(compile=False, channels_last=False, checkpointing=False), s.precision,
                             batch_size=batch)
        if s.arch == "tiny":
            config = dataclasses.replace(config, text_encoder="tiny", vae="tiny")
        out[estimate_key(s.arch, s.resolution, s.precision, batch)] = sd.train.memory.estimate(
            config, batch, s.resolution, "cuda").as_dict()
    return out


def fmt(value, spec: str = ".1f", unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


def table_rows(done: list[Piece], s: Sizes, estimates: dict) -> list[dict]:
    """One row per measurement: what, settings, result, against what, device and torch, command."""
    rows = []

    def add(piece: Piece, what: str, settings: str, result: str, against: str = "", **numbers):
        r = piece.result or {}
        rows.append({"piece": piece.name, "what": what, "settings": settings, "result": result, "against": against,
                     "device": r.get("device", "-"), "torch": r.get("torch", "-"), "command": piece.command,
                     "ended": piece.ended, **numbers})

    for piece in done:
        r = piece.result
        if r is None and not piece.writes_json and piece.ended != "not run":
            add(piece, piece.title, "", piece.last_line or piece.ended)
            continue
        if r is None:
            add(piece, piece.title, "", f"no result: {piece.ended}")
            continue
        if r["benchmark"] == "train_throughput":
            peers = {row["batch"]: row for row in r["rows"] if row["impl"].startswith("peer")}
            for row in r["rows"]:
                batch = row["batch"]
                settings = (f"{r['resolution']} px, batch {batch}, {r['precision']}, fused AdamW, EMA, Min-SNR, "
                            "no checkpointing")
                if row.get("oom") or row.get("error"):
                    add(piece, piece.title, settings, "out of memory" if row.get("oom") else row["error"])
                    continue
                ours = row["impl"] == "ours"
                what = f"training step, {row['variant']}" if ours else "diffusers train_text_to_image.py step"
                if not ours:
                    settings = f"{r['resolution']} px, batch {batch}, {r['precision']} autocast, AdamW, no EMA"
                peer = peers.get(batch)
                against = (f"{row['images_per_s'] / peer['images_per_s']:.2f}x diffusers' step"
                           if ours and peer and peer.get("images_per_s") else "")
                estimate = estimates.get(estimate_key(r["arch"], r["resolution"], r["precision"], batch))
                memory = ""
                if ours and row.get("peak_reserved_gb") is not None:
                    memory = (f"; peak {row['peak_allocated_gb']:.2f} GB allocated, "
                              f"{row['peak_reserved_gb']:.2f} reserved")
                if ours and estimate:
                    memory += (f"; estimate {estimate['allocated_gb']:.2f} allocated, "
                               f"{estimate['reserved_gb']:.2f} reserved")
                    if row.get("peak_reserved_gb"):
                        memory += f" ({100 * (estimate['reserved_gb'] / row['peak_reserved_gb'] - 1):+.1f}%)"
                add(piece, what, settings,
                    f"{row['images_per_s']:.2f} images/s, MFU {fmt(row.get('mfu') and 100 * row['mfu'], '.1f', '%')}"
                    + memory, against, images_per_s=row["images_per_s"], mfu=row.get("mfu"),
                    peak_allocated_gb=row.get("peak_allocated_gb"), peak_reserved_gb=row.get("peak_reserved_gb"),
                    estimate=estimate if ours else None, batch=batch, variant=row["variant"] if ours else "peer")
        elif r["benchmark"] == "host_syncs":
            add(piece, "host syncs per optimizer step", f"{r['resolution']} px, batch {r['batch']}, {r['precision']}, "
                f"{r['steps']} steps ({r['counted_by']})",
                f"{r['syncs_per_step']:g} syncs per step, {r['reads_at_logging']} at the logging read; "
                f"{r['ops_per_step']:,.0f} operators dispatched per step", "0 syncs (goal)",
                syncs_per_step=r["syncs_per_step"], ops_per_step=r["ops_per_step"])
        elif r["benchmark"] == "sampling":
            for row in r["rows"]:
                name = "ours (SD_ImageGen.py)" if row["impl"] == "ours" else "diffusers StableDiffusionPipeline"
                add(piece, f"{s.sampling_steps}-step DDIM sampling, {name}",
                    f"{r['resolution']} px, batch {row['batch']}, CFG, {row['mode']}",
                    f"{row['images_per_s']:.3f} images/s ({row['it_per_s']:.2f} it/s)",
                    images_per_s=row["images_per_s"], impl=row["impl"])
        elif r["benchmark"] == "encode_latents":
            add(piece, "latent encoding, encode_latents.py", f"{r['resolution']} px, batch {r['batch_size']}",
                f"{r['ours_images_per_s']:.1f} images/s ({r['vae_only_images_per_s']:.1f} the VAE alone)",
                f"{r['ratio_vs_naive']:.2f}x the naive loop", images_per_s=r["ours_images_per_s"])
    known = next((row for row in rows if row["device"] != "-"), None)
    for row in rows:  # a piece without a JSON of its own (pytest) ran on the same machine
        if known and row["device"] == "-":
            row["device"], row["torch"] = known["device"], known["torch"]
    return rows


def markdown(rows: list[dict], done: list[Piece], started: str, dry_run: bool, revision: str, argv: list[str]) -> str:
    lines = [f"# GPU window, {started}", ""]
    if dry_run:
        lines += ["**--dry_run**: every piece at the tiny presets on the CPU; the numbers test the command, they "
                  "measure nothing.", ""]
    lines += [f"revision {revision}; command: `OUT=DIR bash bench/gpu_window.sh{''.join(' ' + a for a in argv)}`", "",
              "| measurement | settings | result | against | device, torch | command |", "|---|---|---|---|---|---|"]
    for row in rows:
        cells = [row["what"], row["settings"], row["result"], row["against"] or "-",
                 f"{row['device']}, torch {row['torch']}", f"`{row['command']}`"]
        lines.append("| " + " | ".join(str(cell).replace("|", "/") for cell in cells) + " |")
    lines += ["", "| piece | how it ended | seconds |", "|---|---|---|"]
    lines += [f"| {piece.name} | {piece.ended} | {piece.seconds:.0f} |" for piece in done]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:
        run_script(argv[1], argv[2], argv[3:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("action", nargs="?", default="window", choices=["window", "estimates"],
                        help="window: run the pieces; estimates: write bench/gpu_window_estimates.json (CPU)")
    parser.add_argument("--dry_run", action="store_true", help="every piece at the tiny presets on the CPU")
    parser.add_argument("--out", default=os.environ.get("OUT", ""), help="folder of the table (default: $OUT)")
    parser.add_argument("--budget", type=float, default=None,
                        help=f"seconds for all pieces together (default {BUDGET_S}; none with --dry_run, whose "
                        f"pieces each get {DRY_CAP_SCALE} times their cap)")
    parser.add_argument("--part", choices=["headline", "levers", "all"], default="headline",
                        help="headline: the table's pieces (within --budget, 7 minutes with the install); levers: "
                        "the speed levers side by side, a second command when the window has time left")
    parser.add_argument("--only", default="", help="comma-separated piece names to run (default: all of --part)")
    args = parser.parse_args(argv)
    sizes = DRY if args.dry_run else GPU
    if args.action == "estimates":
        estimates = compute_estimates(GPU)
        sd.files.write_text_atomic(ESTIMATES, json.dumps(estimates, indent=1, sort_keys=True) + "\n")
        print(f"wrote {ESTIMATES.relative_to(ROOT)}: " + ", ".join(
            f"{key} {value['reserved_gb']:.2f} GB reserved" for key, value in estimates.items()))
        return 0
    if not args.out:
        parser.error("name the output folder: OUT=DIR or --out DIR")
    out = Path(args.out)
    folder = out / "pieces"
    folder.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        estimates = compute_estimates(DRY)
    else:
        estimates = json.loads(ESTIMATES.read_text()) if ESTIMATES.exists() else {}
        missing = [b for b in GPU.batches if estimate_key(GPU.arch, GPU.resolution, GPU.precision, b) not in estimates]
        if missing:
            print(f"[gpu_window] {ESTIMATES.name} has no estimate for batch {missing}: run `python bench/gpu_window.py "
                  "estimates` on a CPU before the window; the table shows none", flush=True)
    only = set(args.only.split(",")) - {""}
    unknown = only - {p.name for p in pieces(sizes)}
    if unknown:
        parser.error(f"--only: no piece {sorted(unknown)}; the pieces: {', '.join(p.name for p in pieces(sizes))}")
    chosen = [p for p in pieces(sizes) if args.part in ("all", p.part) and (not only or p.name in only)]
    started, began = datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), time.monotonic()
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip() or "unknown"
    budget = args.budget if args.budget is not None else math.inf if args.dry_run else BUDGET_S
    scale = DRY_CAP_SCALE if args.dry_run else 1
    with preloaded(folder) if args.dry_run else contextlib.nullcontext([sys.executable]) as python:
        for piece in chosen:
            left = budget - (time.monotonic() - began)
            if left < 20:
                piece.ended = "not run: the budget was spent"
                continue
            run_piece(piece, folder, min(piece.cap_s * scale, left), python)
    rows = table_rows(chosen, sizes, estimates)
    name = "gpu_window" if args.part == "headline" else f"gpu_window_{args.part}"
    sd.files.write_text_atomic(out / f"{name}.md", markdown(rows, chosen, started, args.dry_run, revision, argv))
    sd.files.write_text_atomic(out / f"{name}.json", json.dumps({
        "date": started, "dry_run": args.dry_run, "revision": revision, "seconds": round(time.monotonic() - began),
        "pieces": [{"name": p.name, "command": p.command, "ended": p.ended, "seconds": p.seconds} for p in chosen],
        "rows": rows}, indent=1) + "\n")
    print(f"[gpu_window] {time.monotonic() - began:.0f} s; wrote {out / name}.md and {name}.json")
    return 0 if all(p.ended == "ok" for p in chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
