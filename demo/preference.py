"""The demo's preference-tuning row: Diffusion-DPO of the demo model on pairs of its own drawings, ranked by the
demo's colour-and-shape oracle for one half of the prompts, scored on both halves.

    python demo/preference.py halves --prompts runs/demo/shards/demo_prompts.json --out runs/demo/dpo [--repeats 24]
    python demo/preference.py cost --out runs/demo/dpo --draw_s SECONDS --train_s SECONDS
    python demo/preference.py report --out runs/demo/dpo

``halves`` splits the demo's prompts (the seen combinations, then the held-out ones) into two halves, every
other prompt: ``prompts_pairs.txt``, the prompts pairs are drawn for, and ``prompts_unseen.txt``, prompts never
in a pair. It writes ``draw_prompts.txt`` (each pairs prompt ``--repeats`` times: the lines
pipeline/01g_draw_pairs.py draws K images for) and ``halves.json``, demo_prompts.json with the pairs half as
``seen`` and the other as ``held_out``, so demo/evaluate.py scores the two halves apart.

``report`` reads ``eval_<model>_<half>.json`` (demo/evaluate.py of ``samples_<model>_<half>`` against
``halves.json``) for the models ``base`` and ``dpo``, the FID of each sample folder against ``fid_<half>/reference``
(demo/fid.py of the base model's samples of that half: fresh drawings of the same prompts; its offline stand-in
features, so the numbers compare with each other, not with published FIDs) and ``cost.json`` (``cost``: the
seconds of drawing and of encoding and training that demo/run.sh measured, the pairs encoded and the DPO steps
taken), and writes ``preference.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import sd.cli
import sd.files
from demo.evaluate import report_table

MODELS = {"base": "demo model", "dpo": "+ Diffusion-DPO on its own pairs"}
HALVES = {"pairs": "prompts in pairs", "unseen": "prompts never in a pair"}


def halves(prompts_file: Path, out: Path, repeats: int) -> dict:
    prompts = json.loads(prompts_file.read_text())
    ordered = list(prompts["seen"]) + list(prompts["held_out"])
    pairs, unseen = ordered[0::2], ordered[1::2]
    out.mkdir(parents=True, exist_ok=True)
    sd.files.write_text_atomic(out / "prompts_pairs.txt", "".join(p + "\n" for p in pairs))
    sd.files.write_text_atomic(out / "prompts_unseen.txt", "".join(p + "\n" for p in unseen))
    sd.files.write_text_atomic(out / "draw_prompts.txt", "".join(p + "\n" for _ in range(repeats) for p in pairs))
    split = {**prompts, "seen": pairs, "held_out": unseen}
    sd.files.write_json_atomic(out / "halves.json", split)
    held_out = set(prompts["held_out"])
    print(f"pairs half: {len(pairs)} prompts ({sum(p in held_out for p in pairs)} of them held out of the demo "
          f"model's training), never in a pair: {len(unseen)} ({sum(p in held_out for p in unseen)} held out)")
    return split


def cost(out: Path, draw_s: int, train_s: int) -> dict:
    """``cost.json``: what the row took, from the run's own records (the pairs encoded, the steps trained)."""
    latents = json.loads((out / "latents" / "latents.json").read_text())
    steps = [json.loads(line)["step"] for line in (out / "train" / "metrics.jsonl").read_text().splitlines()
             if '"loss"' in line]
    record = {"draw_s": draw_s, "train_s": train_s, "pairs": latents["count"], "steps": steps[-1] if steps else 0}
    sd.files.write_json_atomic(out / "cost.json", record)
    return record


def scores_of(out: Path, model: str, half: str) -> dict | None:
    from demo.fid import fid

    path = out / f"eval_{model}_{half}.json"
    if not path.exists():
        return None
    try:
        scores = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise SystemExit(f"{path}: {error}; run demo/evaluate.py for it again")
    group = scores["seen" if half == "pairs" else "held_out"]  # halves.json: the pairs half is "seen"
    row = {"colour": group["colour"], "shape": group["shape"], "both": group["both"]}
    reference = out / f"fid_{half}" / "reference"
    if reference.is_dir():
        row["fid"] = round(fid(out / f"samples_{model}_{half}", reference, out / f"fid_{model}_{half}.json"), 2)
    return row


def report(out: Path) -> dict:
    table = {}
    for model in MODELS:
        row = {half: scores for half in HALVES if (scores := scores_of(out, model, half)) is not None}
        if row:
            table[model] = row
    numbers = tuple(f"{half} fid" for half in HALVES)
    if (out / "cost.json").exists() and "dpo" in table:
        cost = json.loads((out / "cost.json").read_text())
        table["dpo"]["cost"] = {"steps": cost.get("steps"), "pairs": cost.get("pairs"),
                                "minutes": round((cost.get("draw_s", 0) + cost.get("train_s", 0)) / 60, 1)}
        print(f"DPO's cost: {cost.get('pairs')} pairs drawn and ranked in {cost.get('draw_s', 0) / 60:.1f} min, "
              f"encoded and trained {cost.get('steps')} steps in {cost.get('train_s', 0) / 60:.1f} min")
    shown = {model: {half: scores for half, scores in row.items() if half in HALVES} for model, row in table.items()}
    report_table(out / "preference.json", shown, MODELS, numbers=numbers)
    sd.files.write_text_atomic(out / "preference.json", json.dumps(table, indent=1) + "\n")
    return table


def main(argv=None) -> int:
    parser = sd.cli.ArgumentParser(description=__doc__)
    parser.add_argument("action", choices=("halves", "cost", "report"))
    parser.add_argument("--out", required=True, help="the preference step's folder (runs/demo/dpo)")
    parser.add_argument("--prompts", help="halves: demo_prompts.json of pipeline/00_make_demo_data.py")
    parser.add_argument("--draw_s", type=int, default=0, help="cost: seconds the pairs took to draw and rank")
    parser.add_argument("--train_s", type=int, default=0, help="cost: seconds of encoding them and training")
    parser.add_argument("--repeats", type=int, default=24, help="halves: lines per pairs prompt in draw_prompts.txt "
                        "(each drawn K times by pipeline/01g_draw_pairs.py)")
    args = parser.parse_args(argv)
    if args.action == "halves":
        if not args.prompts:
            parser.error("halves needs --prompts")
        halves(Path(args.prompts), Path(args.out), args.repeats)
    elif args.action == "cost":
        cost(Path(args.out), args.draw_s, args.train_s)
    else:
        report(Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
