"""The demo's flow-matching table: the demo model with DDIM at 50 and 4 steps; the demo model fine-tuned to a
rectified flow (configs/demo_flow.yaml) with Euler at 25, 8 and 4 steps; the flow model reflowed on pairs of
its own ODE (SD_Reflow.py, configs/demo_reflow.yaml) at 2 and 1 steps; and, when make demo's step 11 ran,
the latent consistency model at 2 and 4 steps beside them.

    python demo/flow.py --out runs/demo/flow --lcm runs/demo/lcm_eval --reference runs/demo/fid/reference

Each row: demo/evaluate.py's scores of ``samples_<row>``, its FID against demo/fid.py's reference drawings
(the offline stand-in features: the numbers compare with each other, not with published FIDs), and what its
model cost to train beyond the demo model: optimizer steps and images of each run, and the UNet evaluations
that drew the reflow pairs. Writes ``flow.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import sd.cli
import sd.run_folder
from demo.evaluate import report_table
from demo.lcm import row_scores

ROWS = {"ddim_50": "demo model, DDIM 50 steps", "ddim_4": "demo model, DDIM 4 steps",
        "flow_25": "flow, Euler 25 steps", "flow_8": "flow, Euler 8 steps", "flow_4": "flow, Euler 4 steps",
        "reflow_2": "reflowed, Euler 2 steps", "reflow_1": "reflowed, Euler 1 step",
        "lcm_2": "distilled, LCM 2 steps", "lcm_4": "distilled, LCM 4 steps"}


def run_cost(name: str, run: Path) -> str:
    """A run's optimizer steps and training images (its newest checkpoint's state)."""
    state = torch.load(sd.run_folder.resolve_checkpoint(run) / "train_state.pt", weights_only=True)
    return f"{name} {int(state['step'])} steps, {int(state['samples_seen'])} images"


def pairs_cost(pairs: Path) -> str:
    """The reflow pairs and the UNet evaluations that drew them (two a step with guidance)."""
    settings = json.loads((pairs / "latents" / "latents.json").read_text())["reflow"]
    calls = settings["steps"] * (1 if settings["cfg"] == 1 else 2)
    return f"{settings['n']} pairs, {settings['n'] * calls} UNet evaluations"


def costs(out: Path, lcm: Path | None) -> dict[str, str]:
    """What each kind of row's model cost to train beyond the demo model."""
    flow = run_cost("flow", out / "train")
    cost = {"ddim": "the demo model", "flow": f"+ {flow}",
            "reflow": f"+ {flow}; {pairs_cost(out / 'pairs')}; {run_cost('reflow', out / 'reflow')}"}
    if lcm is not None and (lcm.parent / "lcm").is_dir():
        cost["lcm"] = f"+ {run_cost('distillation', lcm.parent / 'lcm')} (and as many teacher steps)"
    return cost


def report(out: Path, lcm: Path | None, reference: Path | None) -> dict:
    cost = costs(out, lcm)
    table = {}
    for row in ROWS:
        folder = lcm if row.startswith("lcm_") else out
        scores = None if folder is None else row_scores(folder, row, reference)
        if scores is not None:
            table[row] = {**scores, "training": cost[row.split("_")[0]]}
    return report_table(out / "flow.json", table, ROWS, numbers=("fid",))


def main(argv=None) -> int:
    parser = sd.cli.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="the folder of the rows' samples_<row> and eval_<row>.json, "
                        "and of the runs train/ and reflow/ and the pairs/")
    parser.add_argument("--lcm", help="make demo's few-step folder (OUT/lcm_eval): its LCM rows, when it has them")
    parser.add_argument("--reference", help="demo/fid.py's reference drawings (OUT/fid/reference); without it no "
                        "FID column")
    args = parser.parse_args(argv)
    report(Path(args.out), Path(args.lcm) if args.lcm else None, Path(args.reference) if args.reference else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
