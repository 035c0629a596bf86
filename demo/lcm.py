"""The demo's few-step table: the demo model sampled with DDIM at 50, 4, 2 and 1 steps, beside its latent consistency
distillation (configs/demo_lcm.yaml) sampled with the LCM sampler at 2, 4 and 8 steps and its DMD generators
(configs/demo_dmd.yaml) sampled in the steps each was trained for.

    python demo/lcm.py --out runs/demo/lcm_eval --reference runs/demo/fid/reference

Reads each row's ``eval_<row>.json`` (demo/evaluate.py of ``samples_<row>``), scores ``samples_<row>``'s FID
against demo/fid.py's reference drawings of the same prompts (the offline stand-in features: the numbers
compare with each other and with demo/fid.py's floor, not with published FIDs), adds each distillation's training
minutes where ``training_seconds.json`` (demo/run.sh's) records them, and writes ``lcm.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import sd.cli
from demo.evaluate import report_table

ROWS = {"ddim_50": "demo model, DDIM 50 steps", "ddim_4": "demo model, DDIM 4 steps",
        "ddim_2": "demo model, DDIM 2 steps", "ddim_1": "demo model, DDIM 1 step",
        "lcm_2": "distilled, LCM 2 steps", "lcm_4": "distilled, LCM 4 steps", "lcm_8": "distilled, LCM 8 steps",
        **{f"dmd_{n}": f"distilled, DMD {n} step{'s' if n > 1 else ''}" for n in range(1, 5)}}


def row_scores(folder: Path, row: str, reference: Path | None) -> dict | None:
    """A row's scores: demo/evaluate.py's of ``samples_<row>`` (``eval_<row>.json``; None when there is none)
    and, given the reference drawings, its FID."""
    import json

    from demo.fid import fid

    if not (folder / f"eval_{row}.json").exists():
        return None
    try:
        scores = json.loads((folder / f"eval_{row}.json").read_text())
    except (OSError, ValueError) as error:
        raise SystemExit(f"{folder / f'eval_{row}.json'}: {error}; run demo/evaluate.py for it again")
    row_table = {"seen_colour": scores["seen"]["colour"], "seen_shape": scores["seen"]["shape"],
                 "seen_both": scores["seen"]["both"], "held_out_both": scores["held_out"]["both"]}
    if reference is not None:
        row_table["fid"] = round(fid(folder / f"samples_{row}", reference, folder / f"fid_{row}.json"), 2)
    return row_table


def train_minutes(out: Path, row: str) -> float | None:
    """The minutes the distillation a row samples took to train (``training_seconds.json``: lcm, dmd_N), or None."""
    import json

    try:
        seconds = json.loads((out / "training_seconds.json").read_text())
    except (OSError, ValueError):
        return None
    run = "lcm" if row.startswith("lcm_") else row
    return round(seconds[run] / 60, 1) if isinstance(seconds.get(run), (int, float)) else None


def report(out: Path, reference: Path | None) -> dict:
    table = {row: scores for row in ROWS if (scores := row_scores(out, row, reference)) is not None}
    for row, scores in table.items():  # the demo model itself: no distillation (None)
        scores["train_minutes"] = None if row.startswith("ddim_") else train_minutes(out, row)
    return report_table(out / "lcm.json", table, ROWS, numbers=("fid", "train_minutes"))


def main(argv=None) -> int:
    parser = sd.cli.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="the folder of the rows' samples_<row> and eval_<row>.json")
    parser.add_argument("--reference", help="demo/fid.py's reference drawings (OUT/fid/reference); without it no "
                        "FID column")
    args = parser.parse_args(argv)
    report(Path(args.out), Path(args.reference) if args.reference else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
