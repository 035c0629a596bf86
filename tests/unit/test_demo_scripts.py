"""The demo's own scripts (demo/aspect.py, demo/evaluate.py) on ground-truth images."""

import importlib
import json

import numpy as np

import sd.data.buckets
import sd.data.shards


def test_aspect_images_hold_their_shape_outside_the_centre_square(tmp_path):
    import io

    from PIL import Image

    from demo import aspect

    stage00 = importlib.import_module("pipeline.00_make_demo_data")
    assert stage00.main(["--out", str(tmp_path / "demo"), "--count", "10"]) == 0
    prompts = tmp_path / "demo" / "demo_prompts.json"
    assert aspect.main(["images", "--prompts", str(prompts), "--out", str(tmp_path / "aspect"), "--count", "10"]) == 0
    samples, _ = sd.data.shards.read_shard((tmp_path / "aspect" / "shards" / "00000.tar").read_bytes())
    palette = {k: tuple(v) for k, v in json.loads(prompts.read_text())["palette"].items()}
    kinds = []
    for sample in samples:
        image = np.asarray(Image.open(io.BytesIO(sample.image)).convert("RGB"))
        kind = json.loads(sample.metadata)["kind"]
        kinds.append(kind)
        colour = sample.caption.split()[1]
        assert image.shape[:2] == {"wide": (96, 288), "tall": (288, 96), "square": (96, 96)}[kind]
        if kind == "square":
            continue
        square = sd.data.shards.resize_center_crop(image, 64)
        assert (np.abs(square.astype(int) - 255).max(axis=-1) < 40).all()  # the centre square is white
        bucket = (144, 48) if kind == "wide" else (48, 144)
        fitted, _ = sd.data.buckets.fit_to_bucket(image, bucket)
        assert aspect.at_an_end(fitted, colour, palette, (255, 255, 255)) == (True, True)
    assert kinds.count("wide") == kinds.count("tall") == 4 and kinds.count("square") == 2


def test_classifier_reads_the_ground_truth_images(tmp_path):
    import io

    from PIL import Image

    from demo import evaluate

    stage00 = importlib.import_module("pipeline.00_make_demo_data")
    assert stage00.main(["--out", str(tmp_path), "--count", "300", "--shard_size", "100"]) == 0
    prompts = json.loads((tmp_path / "demo_prompts.json").read_text())
    palette = {k: tuple(v) for k, v in prompts["palette"].items()}
    assert len(prompts["seen"]) == 15 and len((tmp_path / "prompts.txt").read_text().splitlines()) == 18
    hits, seen_captions = [], set()
    for shard in sorted(tmp_path.glob("*.tar")):
        samples, truncated = sd.data.shards.read_shard(shard.read_bytes())
        assert truncated is None
        for sample in samples:
            meta = json.loads(sample.metadata)
            image = np.asarray(Image.open(io.BytesIO(sample.image)).convert("RGB"))
            assert image.shape == (64, 64, 3)
            hits.append(evaluate.classify(image, palette) == (meta["colour"], meta["shape"]))
            seen_captions.add(sample.caption)
    assert len(hits) == 300 and all(hits)
    assert not seen_captions & set(prompts["held_out"])  # held-out combinations never reach training
    assert seen_captions <= set(prompts["seen"])


def test_the_few_step_table_reads_each_rows_scores_and_prints_fid_as_a_number(tmp_path, capsys):
    from demo.lcm import report

    for row, both in (("ddim_50", 1.0), ("lcm_4", 0.95), ("dmd_1", 0.9)):
        scores = {"seen": {"colour": 1.0, "shape": both, "both": both, "n": 60},
                  "held_out": {"colour": 0.5, "shape": 0.5, "both": 0.25, "n": 12}}
        (tmp_path / f"eval_{row}.json").write_text(json.dumps(scores))
    (tmp_path / "training_seconds.json").write_text(json.dumps({"lcm": 390, "dmd_1": 900}))
    table = report(tmp_path, None)
    assert table == {"ddim_50": {"seen_colour": 1.0, "seen_shape": 1.0, "seen_both": 1.0, "held_out_both": 0.25,
                                 "train_minutes": None},
                     "lcm_4": {"seen_colour": 1.0, "seen_shape": 0.95, "seen_both": 0.95, "held_out_both": 0.25,
                               "train_minutes": 6.5},
                     "dmd_1": {"seen_colour": 1.0, "seen_shape": 0.9, "seen_both": 0.9, "held_out_both": 0.25,
                               "train_minutes": 15.0}}
    assert json.loads((tmp_path / "lcm.json").read_text()) == table
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[-5:] == ["100%", "100%", "100%", "25%", "-"] and "LCM 4 steps" in lines[2]
    assert "DMD 1 step" in lines[3] and lines[3].split()[-1] == "15.0"


def test_the_preference_row_splits_the_prompts_in_halves_and_reports_each_models_halves(tmp_path, capsys):
    from demo.preference import cost, halves, report

    demo_prompts = {"palette": {"red": [220, 30, 30]}, "shapes": ["circle"], "background": [255, 255, 255],
                    "seen": [f"seen {i}" for i in range(5)], "held_out": ["held 0", "held 1"]}
    (tmp_path / "demo_prompts.json").write_text(json.dumps(demo_prompts))
    split = halves(tmp_path / "demo_prompts.json", tmp_path, repeats=3)
    assert split["seen"] == ["seen 0", "seen 2", "seen 4", "held 1"] and split["held_out"] == ["seen 1", "seen 3", "held 0"]
    assert (tmp_path / "draw_prompts.txt").read_text().splitlines() == split["seen"] * 3  # never an unseen prompt
    assert json.loads((tmp_path / "halves.json").read_text())["palette"] == demo_prompts["palette"]
    for model, both in (("base", 0.5), ("dpo", 0.75)):
        for half, group in (("pairs", "seen"), ("unseen", "held_out")):
            scores = {group: {"colour": 1.0, "shape": both, "both": both, "n": 16}}
            (tmp_path / f"eval_{model}_{half}.json").write_text(json.dumps(scores))
    (tmp_path / "latents").mkdir()
    (tmp_path / "latents" / "latents.json").write_text(json.dumps({"count": 96}))
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 0.6}) + "\n"
                                                               for s in (10, 20)))
    assert cost(tmp_path, draw_s=90, train_s=30) == {"draw_s": 90, "train_s": 30, "pairs": 96, "steps": 20}
    table = report(tmp_path)
    assert table["base"] == {half: {"colour": 1.0, "shape": 0.5, "both": 0.5} for half in ("pairs", "unseen")}
    assert table["dpo"]["unseen"]["both"] == 0.75 and table["dpo"]["cost"] == {"steps": 20, "pairs": 96,
                                                                                "minutes": 2.0}
    assert "Diffusion-DPO" in capsys.readouterr().out


def test_control_images_carry_their_silhouettes_and_a_drawn_shape_matches_its_mask(tmp_path):
    """demo/control.py: each image's seg member is its shape's silhouette (IoU above 0.9 against the shape as
    the report finds it), and the report's IoU is low for the same shape elsewhere."""
    import io

    from PIL import Image

    from demo import control

    stage00 = importlib.import_module("pipeline.00_make_demo_data")
    assert stage00.main(["--out", str(tmp_path / "demo"), "--count", "10"]) == 0
    prompts = tmp_path / "demo" / "demo_prompts.json"
    assert control.main(["images", "--prompts", str(prompts), "--out", str(tmp_path / "control"), "--count", "6"]) == 0
    samples, _ = sd.data.shards.read_shard((tmp_path / "control" / "shards" / "00000.tar").read_bytes())
    assert len(samples) == 6 and all(set(s.controls) == {"seg"} for s in samples)
    white = (255, 255, 255)
    for sample in samples:
        image = np.asarray(Image.open(io.BytesIO(sample.image)).convert("RGB"))
        mask = np.asarray(Image.open(io.BytesIO(sample.controls["seg"])).convert("L"))
        assert control.iou(image, mask, white) > 0.9
    cases = json.loads((tmp_path / "control" / "controls.json").read_text())
    assert len(cases) == control.CASES and len((tmp_path / "control" / "prompts.txt").read_text().splitlines()) == 8
    palette = {k: tuple(v) for k, v in json.loads(prompts.read_text())["palette"].items()}
    colour, shape = cases[0]["prompt"].split()[1:3]
    at_the_mask, at_the_mask_silhouette = control.draw(colour, shape, control.CORNERS[0], 0.4, palette)
    elsewhere, _ = control.draw(colour, shape, control.CORNERS[3], 0.4, palette)
    assert np.array_equal(np.asarray(Image.open(cases[0]["control"]).convert("L")), at_the_mask_silhouette)
    assert control.iou(at_the_mask, at_the_mask_silhouette, white) > 0.9
    assert control.iou(elsewhere, at_the_mask_silhouette, white) < 0.1


def test_a_concept_sample_counts_in_its_colour_only_when_it_is_clearly_that_colour():
    """The demo base model's green drawn for "a sks circle" fell nearest to the concept's cyan: a blend is not
    the new colour. A cyan near the reference is."""
    from demo import evaluate

    palette = {"green": (40, 170, 60), "blue": (40, 80, 220), "cyan": (22, 184, 201)}
    assert not evaluate.clearly(np.array([30, 177, 138], np.float32), "cyan", palette)  # nearest cyan, 64 away
    assert evaluate.clearly(np.array([24, 185, 205], np.float32), "cyan", palette)
    assert not evaluate.clearly(None, "cyan", palette)
    # Half the way to the nearest other colour (blue, 107 away) is the line.
    toward_blue = np.array(palette["cyan"], np.float32) + 0.45 * (np.array(palette["blue"]) - palette["cyan"])
    assert evaluate.clearly(toward_blue, "cyan", palette)
    assert not evaluate.clearly(toward_blue + 0.1 * (np.array(palette["blue"]) - palette["cyan"]), "cyan", palette)
