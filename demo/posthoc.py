"""The demo's post-hoc EMA table: FID of EMAs of several lengths rebuilt after training (``SD_ImageGen.py
--ema_length``) beside the classic EMA's, each against the same fresh ground-truth drawings (demo/fid.py).

    python demo/posthoc.py --out runs/demo --lengths 0.05,0.10,0.20

Reads ``OUT/fid/fid.json`` (the classic EMA's samples, step 6) and ``OUT/posthoc/LENGTH/fid/fid.json``;
writes ``OUT/posthoc.json`` and prints the table (FID with the offline stand-in features: the rows compare
with each other and with the floor and the blank canvas, not with published FIDs).
"""

from __future__ import annotations

import json
from pathlib import Path

import sd.cli
import sd.files


def main(argv=None) -> int:
    parser = sd.cli.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="the demo's output folder")
    parser.add_argument("--lengths", required=True, help="the rebuilt lengths (sigma_rel), comma-separated")
    args = parser.parse_args(argv)
    out = Path(args.out)
    classic = json.loads((out / "fid" / "fid.json").read_text())
    rows = {"classic EMA": classic["samples"]}
    for length in (x.strip() for x in args.lengths.split(",") if x.strip()):
        rows[f"post-hoc EMA sigma_rel {length}"] = json.loads(
            (out / "posthoc" / length / "fid" / "fid.json").read_text())["samples"]
    result = {"fid": rows, "ground_truth": classic["ground_truth"], "blank": classic["blank"]}
    sd.files.write_json_atomic(out / "posthoc.json", result)
    width = max(len(name) for name in rows)
    for name, value in [*rows.items(), ("ground truth (floor)", classic["ground_truth"]),
                        ("blank canvas", classic["blank"])]:
        print(f"  {name:<{width}}  FID {value:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
