"""bench/gpu_window.sh, the command a borrowed GPU runs first: its pieces proven on the CPU (--dry_run), its
GPU command lines parsed by the scripts they call, and everything it imports on the GPU machine's package
list (bench/gpu_machine.txt) or carried as a wheel (bench/gpu_wheels.txt)."""

import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from bench import gpu_window

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("piece", [p for p in gpu_window.pieces(gpu_window.GPU) if p.writes_json],
                         ids=lambda piece: piece.name)
def test_each_gpu_command_line_parses_in_its_script(piece):
    """A typo in a flag of the GPU sizes (which only a window runs) fails here, not in the window."""
    module = importlib.import_module(piece.script.removesuffix(".py").replace("/", "."))
    args = module.parse_args([*piece.args, "--json", "x.json"])
    assert args.device == "cuda" and args.json == "x.json"
    if "--batch_sizes" in piece.args:
        assert args.batch_sizes == piece.args[piece.args.index("--batch_sizes") + 1]


def test_the_gpu_sizes_fit_the_window():
    """7 minutes of wall time at most: the pieces' caps are cut to the budget, which leaves room to install."""
    assert sum(piece.cap_s for piece in gpu_window.pieces(gpu_window.GPU)) >= gpu_window.BUDGET_S  # it binds
    assert gpu_window.BUDGET_S + 20 <= 7 * 60


def test_a_dry_run_on_a_busy_cpu_runs_every_piece_under_wider_caps(tmp_path, monkeypatch):
    """Each piece taking 300 s of a loaded 2-core machine: the window's 400 s budget once left the later pieces
    unrun and the dry run exited 1; a dry run has no overall budget and gives each piece five times its cap
    (a hang still ends it), while the window keeps both."""
    import contextlib

    clock, caps = [0.0], {}

    def slow_piece(piece, folder, cap_s, python):
        clock[0] += 300
        caps[piece.name] = cap_s
        piece.ended, piece.seconds = "ok", 300

    monkeypatch.setattr(gpu_window, "run_piece", slow_piece)
    monkeypatch.setattr(gpu_window, "compute_estimates", lambda sizes: {})
    monkeypatch.setattr(gpu_window, "preloaded", lambda folder: contextlib.nullcontext([sys.executable]))
    monkeypatch.setattr(gpu_window, "table_rows", lambda chosen, sizes, estimates: [])
    monkeypatch.setattr(gpu_window.time, "monotonic", lambda: clock[0])
    headline = [p for p in gpu_window.pieces(gpu_window.DRY) if p.part == "headline"]
    assert gpu_window.main(["--dry_run", "--out", str(tmp_path / "dry")]) == 0
    assert caps == {p.name: p.cap_s * gpu_window.DRY_CAP_SCALE for p in headline}
    caps.clear()
    assert gpu_window.main(["--out", str(tmp_path / "window")]) == 1  # the window's budget binds: 2 pieces run
    assert len(caps) == 2 and all(cap <= gpu_window.BUDGET_S for cap in caps.values())


def test_the_carried_estimates_cover_the_measured_batches():
    estimates = json.loads(gpu_window.ESTIMATES.read_text())
    for batch in gpu_window.GPU.batches:
        estimate = estimates[gpu_window.estimate_key("sd1", 512, "bf16", batch)]
        assert estimate["batch_size"] == batch and estimate["resolution"] == 512
        assert 5 < estimate["reserved_gb"] < 139  # an SD 1.x step at 512 px fits one H200


def test_each_wheel_needs_only_the_machine_and_the_other_wheels():
    machine, wheels = gpu_window.package_list("gpu_machine.txt"), gpu_window.package_list("gpu_wheels.txt")
    assert "torch" in machine and "transformers" in machine and "diffusers" in wheels
    checked = 0
    for name, version in wheels.items():
        if importlib.metadata.version(name) != version:
            continue  # another version here: its requirements are not the carried one's
        checked += 1
        for text in importlib.metadata.requires(name) or []:
            requirement = Requirement(text)
            if requirement.marker and not requirement.marker.evaluate({"python_version": "3.12", "extra": ""}):
                continue
            need = gpu_window.normalise(requirement.name)
            assert need in machine or need in wheels, f"{name} {version} needs {requirement}: on neither list"
            have = machine.get(need) or wheels.get(need)
            if have:
                assert requirement.specifier.contains(have, prereleases=True), (
                    f"{name} {version} needs {requirement}; the GPU machine has {have}")
    assert checked >= 1  # diffusers is pinned at the version this environment tests


def missing_on_the_machine(imported: set[str]) -> list[str]:
    """The imported top-level modules whose distribution is on neither list."""
    machine, wheels = gpu_window.package_list("gpu_machine.txt"), gpu_window.package_list("gpu_wheels.txt")
    distributions = importlib.metadata.packages_distributions()
    missing = []
    for name in sorted(imported):
        owners = {gpu_window.normalise(owner) for owner in distributions.get(name, [])}
        if not owners or not owners & (set(machine) | set(wheels)):
            missing.append(f"{name} (from {', '.join(sorted(owners)) or 'no installed distribution'})")
    return missing


def test_the_import_check_names_what_the_machine_lacks():
    assert missing_on_the_machine({"torch", "PIL", "cv2", "yaml", "diffusers"}) == []
    assert missing_on_the_machine({"torch", "duckdb", "wandb"}) == ["duckdb (from duckdb)", "wandb (from wandb)"]


@pytest.mark.slow
def test_the_dry_run_writes_the_whole_table_and_imports_only_what_the_machine_has(tmp_path):
    """Both parts, each kind of piece once: not the second batch of the training steps (the same command at
    another size), nor the compiled levers (the compiled step runs in train_compiled_*, channels_last is a
    flag of the same command, and on a CPU the backend ignores the CUDA graphs mode); the command lines of
    those are checked above."""
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out")}
    batch = gpu_window.DRY.batches[0]
    chosen = [p for p in gpu_window.pieces(gpu_window.DRY) if p.name not in ("lever_cuda_graphs", "lever_channels_last")
              and not (p.name.startswith("train_") and not p.name.endswith(f"_{batch}"))]
    result = subprocess.run(["bash", str(ROOT / "bench" / "gpu_window.sh"), "--dry_run", "--part", "all", "--only",
                             ",".join(p.name for p in chosen)], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = (tmp_path / "out" / "gpu_window_all.md").read_text()
    report = json.loads((tmp_path / "out" / "gpu_window_all.json").read_text())
    assert report["dry_run"] and [p["name"] for p in report["pieces"]] == [p.name for p in chosen]
    assert {p["ended"] for p in report["pieces"]} == {"ok"}
    rows = report["rows"]
    headline = [r for r in rows if not r["piece"].startswith("lever")]
    for variant in ("eager", "compile", "peer"):
        (row,) = [r for r in headline if r.get("batch") == batch and r.get("variant") == variant]
        assert row["images_per_s"] > 0 and row["device"] == "cpu" and row["torch"] and row["command"]
        assert (row["mfu"] or 0) > 0  # --peak_tflops 1 in the dry run fills the column
        if variant != "peer":
            assert row["estimate"]["batch_size"] == batch
        if variant == "eager":
            assert row["against"].endswith("x diffusers' step")
    (syncs,) = [r for r in rows if r["piece"] == "host_syncs"]
    assert syncs["syncs_per_step"] == 0 and syncs["ops_per_step"] > 100
    assert {r.get("impl") for r in rows if r["piece"] == "sampling"} == {"ours", "peer"}
    assert [r for r in rows if r["piece"] == "encode"][0]["images_per_s"] > 0
    assert [r["variant"] for r in rows if r["piece"].startswith("lever")] == [
        "eager", "eager+attention:cudnn", "eager", "eager+bf16_weights"]
    (tests,) = [r for r in rows if r["piece"] == "gpu_tests"]
    assert "skipped" in tests["result"] and tests["device"] == "cpu"  # no GPU here: the CUDA checks skip
    assert table.count("\n| ") == len(rows) + 1 + len(report["pieces"]) + 1  # the two tables' rows and headings
    imported = set()
    for piece in chosen:
        imported |= set((tmp_path / "out" / "pieces" / f"{piece.name}.imports").read_text().split())
    assert {"torch", "diffusers", "transformers", "numpy"} <= imported
    assert missing_on_the_machine(imported) == []
