"""SD_Eval.py: FID, CLIP score and Inception Score on the tiny stand-in extractors, on demand and in training."""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.linalg
import torch
from PIL import Image

import sd.distributed
import sd.evaluation
import sd.model
import sd.run_folder
import sd.sampling
import sd.train.metrics
import SD_Eval
from sd.distributed import Dist

from data_factory import train_tiny_run

ROOT = Path(__file__).resolve().parents[2]
demo_data = importlib.import_module("pipeline.00_make_demo_data")
COLOURS, SHAPES = ("red", "green", "blue", "yellow"), ("circle", "square", "triangle")


def shapes(folder: Path, n: int, seed: int, size: int = 32, noise: float = 0.0, start: int = 0) -> list[str]:
    """``n`` PNGs of coloured shapes (the demo's drawing), optionally with Gaussian pixel noise; their prompts."""
    folder.mkdir(parents=True, exist_ok=True)
    rng, prompts = np.random.default_rng(seed), []
    for i in range(n):
        colour, shape = COLOURS[i % 4], SHAPES[(i // 4) % 3]
        image, _ = demo_data.draw_shape(colour, shape, size, rng)
        if noise:
            image = np.clip(image + np.random.default_rng(1000 + i).normal(0, noise, image.shape), 0, 255)
        Image.fromarray(image.astype(np.uint8)).save(folder / f"{start + i:05d}.png")
        prompts.append(f"a {colour} {shape}")
    return prompts


def score(*args) -> dict:
    out = Path(args[args.index("--images") + 1]) / "scores.json"
    assert SD_Eval.main([*args, "--features", "tiny", "--device", "cpu"]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reference")
    shapes(folder, 96, seed=0)
    return folder


def test_fid_of_a_set_against_itself_is_zero_and_the_reference_is_cached(reference, tmp_path):
    result = score("--images", str(reference), "--reference", str(reference), "--out", str(reference / "scores.json"))
    assert abs(result["fid"]) < 1e-6 and result["n"] == 96 and result["reference_n"] == 96
    cache = reference / "fid_stats.tiny.npz"
    assert cache.exists()
    again = SD_Eval.main(["--images", str(reference), "--reference", str(cache), "--features", "tiny",
                          "--out", str(tmp_path / "s.json"), "--device", "cpu"])
    assert again == 0 and json.loads((tmp_path / "s.json").read_text())["fid"] == result["fid"]


def test_fid_rises_monotonically_as_noise_is_added(reference, tmp_path):
    fids = []
    for noise in (0, 4, 12, 30, 60):
        folder = tmp_path / f"noise{noise}"
        shapes(folder, 96, seed=0, noise=noise)
        fids.append(score("--images", str(folder), "--reference", str(reference))["fid"])
    assert fids[0] < 1e-6
    assert all(b > a for a, b in zip(fids, fids[1:])), fids


def test_fid_equals_a_direct_scipy_sqrtm_implementation(reference, tmp_path):
    other = tmp_path / "other"
    shapes(other, 80, seed=7, noise=20)
    extractors = sd.evaluation.Extractors("tiny", None)
    feats = [extractors.features([np.asarray(Image.open(p).convert("RGB")) for p in sd.evaluation.image_files(f)])[0]
             for f in (other, reference)]
    (mu1, s1), (mu2, s2) = [(f.astype(np.float64).mean(0), np.cov(f.astype(np.float64), rowvar=False)) for f in feats]
    covmean = scipy.linalg.sqrtm(s1 @ s2).real
    direct = float(((mu1 - mu2) ** 2).sum() + np.trace(s1) + np.trace(s2) - 2 * np.trace(covmean))
    ours = score("--images", str(other), "--reference", str(reference))["fid"]
    assert direct > 1 and abs(ours - direct) < 1e-3, (ours, direct)


def test_clip_score_equals_the_direct_cosine_similarity(reference, tmp_path):
    prompts = [f"a {COLOURS[i % 4]} {SHAPES[(i // 4) % 3]}" for i in range(96)]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    result = score("--images", str(reference), "--reference", str(reference), "--prompts",
                   str(tmp_path / "prompts.txt"), "--out", str(reference / "scores.json"))
    extractors = sd.evaluation.Extractors("tiny", "tiny")
    model, tokenizer = extractors.clip, extractors.tokenizer
    images = [np.asarray(Image.open(p).convert("RGB")) for p in sd.evaluation.image_files(reference)]
    tokens = tokenizer(prompts, padding="max_length", max_length=77, truncation=True, return_tensors="pt")
    pixels = torch.stack([sd.evaluation.clip_pixels(image, 32) for image in images])
    with torch.no_grad():
        out = model(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, pixel_values=pixels)
    cosines = (out.image_embeds * out.text_embeds).sum(-1).double()  # both unit length
    direct = float((100 * cosines.clamp(min=0)).mean())
    assert abs(result["clip_score"] - direct) < 1e-4, (result["clip_score"], direct)


def test_inception_score_is_one_for_identical_predictions_and_c_for_confident_distinct_ones():
    uniform = sd.evaluation.InceptionScore(40, splits=4)
    uniform.add(np.zeros((40, 10)), 0)
    assert uniform.value()[0] == pytest.approx(1.0)
    confident = sd.evaluation.InceptionScore(40, splits=4)
    logits = np.full((40, 10), -50.0)
    logits[np.arange(40), np.arange(40) % 10] = 50.0
    confident.add(logits[:25], 0)
    confident.add(logits[25:], 25)
    mean, std = confident.value()
    assert mean == pytest.approx(10.0, rel=1e-6) and std < 1e-6


def test_an_inception_score_over_non_finite_logits_is_an_error_not_a_number():
    """A NaN logit once made the score NaN (or a number from the images left), reported as a result."""
    score = sd.evaluation.InceptionScore(8, splits=2)
    logits = np.zeros((8, 10))
    logits[3, 2] = np.nan
    logits[6, 0] = np.inf
    score.add(logits, 0)
    with pytest.raises(sd.evaluation.EvalError, match="run a: 2 of 8 images have Inception logits that are not finite"):
        score.value("run a")


def test_statistics_do_not_depend_on_the_batching(reference):
    extractors = sd.evaluation.Extractors("tiny", None)
    images = [np.asarray(Image.open(p).convert("RGB")) for p in sd.evaluation.image_files(reference)]
    features = extractors.features(images)[0].astype(np.float64)
    results = []
    for batch in (7, 13, 96):
        stats = sd.evaluation.FeatureStats(features.shape[1], chunk=10)  # 9 full chunks and a partial one
        for start in range(0, len(features), batch):
            stats.add(features[start : start + batch])
        results.append(stats.mean_cov())
    mu, sigma = results[0]
    assert all(np.array_equal(mu, m) and np.array_equal(sigma, s) for m, s in results[1:])  # bit for bit
    np.testing.assert_allclose(mu, features.mean(0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(sigma, np.cov(features, rowvar=False), rtol=1e-9, atol=1e-10)


def test_a_damaged_image_is_skipped_and_named(reference, tmp_path):
    folder = tmp_path / "images"
    shapes(folder, 12, seed=9)
    (folder / "00005.png").write_bytes((folder / "00005.png").read_bytes()[:40])  # truncated
    result = score("--images", str(folder), "--reference", str(reference), "--inception_score")
    assert result["n"] == 11 and len(result["skipped"]) == 1 and result["skipped"][0].startswith("00005.png")
    assert 1 <= result["inception_score"] <= 10 and result["inception_score_std"] >= 0  # 10 stand-in classes


def test_prompts_come_from_text_or_a_caption_column(tmp_path):
    (tmp_path / "p.txt").write_text("a red circle\n\n  a blue square  \n")
    assert sd.evaluation.read_prompts(tmp_path / "p.txt") == ["a red circle", "a blue square"]
    (tmp_path / "coco.tsv").write_text("image_id\tfile_name\tcaption\n1\ta.jpg\tA dog on a bed.\n2\tb.jpg\tTwo cats.\n")
    assert sd.evaluation.read_prompts(tmp_path / "coco.tsv", 1) == ["A dog on a bed."]
    (tmp_path / "bad.csv").write_text("id,text\n1,a dog\n")
    with pytest.raises(sd.evaluation.EvalError, match="needs a 'caption' column"):
        sd.evaluation.read_prompts(tmp_path / "bad.csv")
    with pytest.raises(sd.evaluation.EvalError, match="has 2 prompts, fewer than the 5"):
        sd.evaluation.read_prompts(tmp_path / "coco.tsv", 5)


def test_a_changed_reference_folder_is_computed_again(tmp_path):
    folder = tmp_path / "ref"
    shapes(folder, 20, seed=3)
    images = tmp_path / "images"
    shapes(images, 20, seed=4)
    first = score("--images", str(images), "--reference", str(folder))["fid"]
    shapes(folder, 20, seed=5, noise=40)  # the same names, new contents
    second = score("--images", str(images), "--reference", str(folder))["fid"]
    assert second != first


def test_bad_inputs_stop_with_a_message_naming_them(reference, tmp_path, capsys):
    np.savez(tmp_path / "wide.npz", mu=np.zeros(2048), sigma=np.eye(2048))
    args = ["--features", "tiny", "--device", "cpu", "--out", str(tmp_path / "s.json")]
    assert SD_Eval.main(["--images", str(reference), "--reference", str(tmp_path / "wide.npz"), *args]) == 2
    assert "wide.npz: statistics of 2048-d features" in capsys.readouterr().err
    (tmp_path / "three.txt").write_text("a\nb\nc\n")
    assert SD_Eval.main(["--images", str(reference), "--reference", str(reference), "--prompts",
                         str(tmp_path / "three.txt"), *args]) == 2
    assert "3 prompts for 96 images" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert SD_Eval.main(["--images", str(tmp_path / "empty"), "--reference", str(reference), *args]) == 2
    assert "no images" in capsys.readouterr().err
    (tmp_path / "broken.npz").write_bytes(b"not a zip")
    assert SD_Eval.main(["--images", str(reference), "--reference", str(tmp_path / "broken.npz"), *args]) == 2
    assert "broken.npz" in capsys.readouterr().err
    sigma = np.eye(64)
    sigma[3, 5] = np.nan
    np.savez(tmp_path / "nan.npz", mu=np.zeros(64), sigma=sigma)  # eigh of it: "Eigenvalues did not converge"
    assert SD_Eval.main(["--images", str(reference), "--reference", str(tmp_path / "nan.npz"), *args]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'nan.npz'}: 'sigma' holds 1 of 4096 values that are not finite" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "s.json").exists()


@pytest.mark.parametrize("name, value", [("mu", np.nan), ("mu", np.inf), ("sigma", -np.inf)])
def test_reference_statistics_that_are_not_finite_are_refused_naming_the_file(tmp_path, name, value):
    stats = {"mu": np.zeros(64), "sigma": np.eye(64)}
    stats[name].flat[0] = value
    np.savez(tmp_path / "ref.npz", **stats)
    with pytest.raises(sd.evaluation.EvalError, match=rf"ref\.npz: '{name}' holds 1 of \d+ values that are not finite"):
        sd.evaluation.load_stats(tmp_path / "ref.npz", "tiny", 64)


def test_features_that_are_not_finite_are_an_error_naming_the_images():
    stats = sd.evaluation.FeatureStats(4, chunk=2)
    stats.add(np.array([[1.0, 2, 3, 4], [np.nan, 0, 0, 0], [0, 1, 0, 1]]))
    with pytest.raises(sd.evaluation.EvalError, match="generated: 1 of 3 images have features that are not finite"):
        stats.mean_cov("generated")


def test_a_damaged_cached_reference_is_computed_again(tmp_path):
    shapes(tmp_path / "ref", 4, seed=3)
    extractors, d = sd.evaluation.Extractors("tiny", None), sd.distributed.Dist.single()
    first = sd.evaluation.reference_stats(str(tmp_path / "ref"), extractors, d, 4)
    cache = Path(first["path"])
    with np.load(cache) as data:
        np.savez(cache, **{**data, "mu": np.full(64, np.nan)})
    again = sd.evaluation.reference_stats(str(tmp_path / "ref"), extractors, d, 4)
    assert np.array_equal(again["mu"], first["mu"])
    assert np.array_equal(sd.evaluation.load_stats(cache, "tiny", 64)["mu"], first["mu"])  # written again


def test_a_training_evaluation_that_fails_is_logged_and_the_run_goes_on(caplog):
    from types import SimpleNamespace

    import sd.train.validation

    def evaluation(pipe, d, stop=None):
        raise sd.evaluation.EvalError("generated images: 1 of 6 images have features that are not finite")

    run = SimpleNamespace(step=SimpleNamespace(unet=torch.nn.Linear(1, 1), ema=None, emas=lambda: []),
                          evaluation=evaluation,
                          config=SimpleNamespace(precision="fp32"), d=sd.distributed.Dist.single(),
                          state=SimpleNamespace(step=7), sampler=None)
    assert sd.train.validation.evaluate(run) == {}
    assert "step 7: no evaluation scores: generated images: 1 of 6 images" in caplog.text
    assert run.step.unet.training


# ---------------------------------------------------------------------------------------------
# Generated images: a tiny trained run, on one and two ranks, and during training
# ---------------------------------------------------------------------------------------------

EVAL_FIELDS = dict(eval_features="tiny", eval_clip_model="tiny", eval_n=6, eval_batch_size=4, validation_steps=3,
                   validation_cfg=3.0, validation_width=64, validation_height=64)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, reference):
    """A tiny run evaluated every 2 steps against the reference folder; its prompts file."""
    root = tmp_path_factory.mktemp("trained")
    prompts = root / "prompts.txt"
    prompts.write_text("".join(f"a {c} {s}\n" for s in SHAPES for c in COLOURS))
    run = train_tiny_run(root, 32, max_steps=4, warmup_steps=1, ema_decay=0.5, save_steps=2, keep_checkpoints=3,
                         log_every=1, validate_every=0, eval_every=2, eval_prompts=str(prompts),
                         eval_reference=str(reference), **EVAL_FIELDS)
    return run, prompts


def generate_args(checkpoint, prompts, reference, images, count=("--num_prompts", "6")):
    return ["--ckpt", str(checkpoint), "--prompts", str(prompts), *count, "--batch_size", "4", "--steps", "3",
            "--cfg", "3.0", "--seed", "5", "--height", "64", "--width", "64", "--reference", str(reference),
            "--images", str(images), "--precision", "fp32"]


@pytest.mark.slow
def test_training_time_evaluation_is_logged_and_equals_the_checkpoints_evaluation(trained, reference, tmp_path,
                                                                                    capsys):
    run, prompts = trained
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in records if "eval_fid" in r}
    assert sorted(evals) == [2, 4]
    assert all(r["eval_n"] == 6 and np.isfinite(r["eval_fid"]) and r["eval_clip_score"] >= 0 for r in evals.values())
    assert evals[2]["eval_fid"] != evals[4]["eval_fid"]
    assert all("loss" in r for r in evals.values())
    # The logged numbers are those of SD_Eval.py on that step's checkpoint (EMA weights, seed = the run's seed).
    checkpoint = run / "checkpoints" / sd.run_folder.step_dir_name(4)
    result = score(*generate_args(checkpoint, prompts, reference, tmp_path / "images"))
    assert result["fid"] == pytest.approx(evals[4]["eval_fid"], abs=1e-9)
    assert result["clip_score"] == pytest.approx(evals[4]["eval_clip_score"], abs=1e-9)
    # A re-run into that folder with other settings is refused before any work (never mixes stale images).
    changed = generate_args(checkpoint, prompts, reference, tmp_path / "images")
    changed[changed.index("--cfg") + 1] = "5.0"
    assert SD_Eval.main([*changed, "--features", "tiny", "--device", "cpu"]) == 2
    assert "cfg differ: 3.0 then, 5.0 now" in capsys.readouterr().err
    # The loss plot has the evaluation panel beside it.
    sd.train.metrics.plot_metrics(run / "metrics.jsonl", tmp_path / "loss.png")
    assert Image.open(tmp_path / "loss.png").size[0] == 1200


@pytest.fixture
def one_core_per_process(monkeypatch):
    """One CPU thread in this process, as each of two ranks has on a 2-core machine: CPU kernels round
    differently with other thread counts (one GPU per rank has no such difference)."""
    threads = torch.get_num_threads()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(os.cpu_count()))  # sd.distributed.setup: cores / local ranks
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_generated_scores_are_identical_on_rerun_and_on_two_ranks(trained, reference, tmp_path, one_core_per_process):
    run, prompts = trained
    checkpoint = run / "checkpoints" / sd.run_folder.step_dir_name(4)
    per_prompt = ("--num_prompts", "3", "--n", "2")  # --n: images per prompt, as in SD_ImageGen.py
    one = score(*generate_args(checkpoint, prompts, reference, tmp_path / "one", per_prompt))
    assert torch.get_num_threads() == 1
    assert len(list((tmp_path / "one").glob("*.png"))) == 6 and one["n"] == 6
    records = json.loads((tmp_path / "one" / "images.json").read_text())
    assert [r["seed"] for r in records] == [5, 6, 7, 8, 9, 10]
    assert [r["prompt"] for r in records] == [p for p in prompts.read_text().splitlines()[:3] for _ in range(2)]
    stamp = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "one").glob("*.png")}
    again = score(*generate_args(checkpoint, prompts, reference, tmp_path / "one", per_prompt))  # read back
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "one").glob("*.png")} == stamp
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_WORLD_SIZE"}
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          str(ROOT / "SD_Eval.py"), *generate_args(checkpoint, prompts, reference, tmp_path / "two",
                                                              ("--num_prompts", "3", "--images_per_prompt", "2")),
                          "--features", "tiny", "--device", "cpu"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    two_scores = json.loads((tmp_path / "two" / "scores.json").read_text())
    for key in ("fid", "clip_score", "n"):
        assert one[key] == again[key] == two_scores[key], key
    for path in sorted((tmp_path / "one").glob("*.png")):
        assert np.array_equal(np.asarray(Image.open(path)), np.asarray(Image.open(tmp_path / "two" / path.name)))


@pytest.mark.slow
def test_per_phase_table_evaluates_the_newest_checkpoint_of_each_run(trained, reference, tmp_path):
    run, prompts = trained
    table = tmp_path / "phases.md"
    args = ["--runs", str(run), "--prompts", str(prompts), "--num_prompts", "6", "--batch_size", "4", "--steps", "3", "--cfg",
            "3.0", "--seed", "5", "--height", "64", "--width", "64", "--reference", str(reference), "--table",
            str(table), "--features", "tiny", "--device", "cpu", "--precision", "fp32"]
    assert SD_Eval.main(args) == 0
    rows = json.loads(table.with_suffix(".json").read_text())
    assert [(r["step"], r["images_seen"]) for r in rows] == [(4, 4 * 8)]
    logged = {json.loads(line)["step"]: json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()}
    assert rows[0]["fid"] == pytest.approx(logged[4]["eval_fid"], abs=1e-9)
    assert f"| {run} | 4 | 32 | {rows[0]['fid']:.3f} |" in table.read_text()
    assert (run / "eval" / sd.run_folder.step_dir_name(4) / "scores.json").exists()


def test_training_evaluation_settings_are_checked_before_any_work(tmp_path):
    from sd.train.config import ConfigError, TrainConfig

    base = dict(datasets=[{"dataset": str(tmp_path), "latents": str(tmp_path)}], unet="tiny", vae="tiny",
                text_encoder="tiny", max_steps=2)
    with pytest.raises(ConfigError, match="eval.every > 0 needs eval.prompts"):
        TrainConfig(**base, eval_every=10).validate(check_paths=False)
    with pytest.raises(ConfigError, match="eval.prompts: .*missing.txt does not exist"):
        TrainConfig(**base, eval_every=10, eval_prompts=str(tmp_path / "missing.txt"),
                    eval_reference=str(tmp_path)).validate()
    with pytest.raises(ConfigError, match="eval.features: inception or tiny"):
        TrainConfig(**base, eval_features="vgg").validate(check_paths=False)


def test_a_stop_ends_an_evaluation_between_denoising_steps_and_on_every_rank_at_the_same_gather(reference,
                                                                                                monkeypatch):
    pipe = sd.sampling.Pipeline(sd.model.build_unet("tiny", seed=0), sd.model.load_vae("tiny"),
                                sd.model.load_text_encoder("tiny"), sd.model.load_tokenizer("tiny"), "epsilon")
    calls = []
    pipe.unet.register_forward_pre_hook(lambda *_: calls.append(1))
    extractors = sd.evaluation.Extractors("tiny", "tiny")
    stats = sd.evaluation.reference_stats(str(reference), extractors, Dist.single(), 32)
    settings = sd.evaluation.Sampling(steps=3, cfg=3.0, height=32, width=32)
    prompts = [f"a red {shape}" for shape in SHAPES] * 2  # 3 batches of 2

    def evaluate(d: Dist, stop):
        return sd.evaluation.evaluate_pipeline(pipe, prompts, settings, extractors, stats, d, 2, stop=stop)

    assert evaluate(Dist.single(), lambda: False)["n"] == 6 and len(calls) == 9
    # One rank: asked before each denoising step, the stop comes in the second batch after one step of three.
    calls.clear()
    with pytest.raises(sd.distributed.Stopped):
        evaluate(Dist.single(), lambda: len(calls) >= 4)
    assert len(calls) == 4
    # Rank 1 of 2 (batch 1, then batch 3): rank 0 reports its stop with the first round's batch, and
    # rank 1 leaves after that same gather though its own stop() never answers True.
    gathers = []
    monkeypatch.setattr(sd.distributed, "all_gather_objects",
                        lambda value, d: gathers.append(value) or [(None, True, None), value])
    calls.clear()
    with pytest.raises(sd.distributed.Stopped):
        evaluate(Dist(1, 2, 1, torch.device("cpu"), False), lambda: False)
    assert len(gathers) == 1 and len(calls) == 3 and gathers[0][1] is False


def test_an_error_in_one_ranks_share_reaches_every_rank_at_the_same_gather(monkeypatch):
    """Rank 1 of 2: rank 0's work failed, so rank 1 raises Failed naming it after that round's gather, though its
    own work went well; when its own work fails, it takes part in the gather (rank 0 is not left waiting), then
    raises its own error. One rank alone raises its error at once."""
    gathers = []
    told = "rank 0: RuntimeError: out of memory"
    monkeypatch.setattr(sd.distributed, "all_gather_objects",
                        lambda value, d: gathers.append(value) or [(None, False, told), value])
    rank1 = Dist(1, 2, 1, torch.device("cpu"), False)
    with pytest.raises(sd.distributed.Failed, match="^rank 0: RuntimeError: out of memory$"):
        list(sd.evaluation.gather_in_order(4, lambda k: k, rank1))
    assert gathers == [(1, False, None)]

    def broken(k):
        raise ValueError("a NaN in the features\nmore")

    gathers.clear()
    monkeypatch.setattr(sd.distributed, "all_gather_objects",
                        lambda value, d: gathers.append(value) or [(0, False, None), value])
    with pytest.raises(ValueError, match="a NaN in the features"):
        list(sd.evaluation.gather_in_order(4, broken, rank1))
    assert gathers == [(None, False, "rank 1: ValueError: a NaN in the features")]
    gathers.clear()
    with pytest.raises(ValueError, match="a NaN in the features"):
        list(sd.evaluation.gather_in_order(4, broken, Dist.single()))
    assert gathers == []


@pytest.mark.slow
def test_evaluating_during_training_leaves_the_training_bit_for_bit_unchanged(trained, tmp_path):
    from safetensors.torch import load_file

    run, _ = trained
    plain = train_tiny_run(tmp_path, 32, max_steps=4, warmup_steps=1, ema_decay=0.5, save_steps=2, keep_checkpoints=3,
                           log_every=1, validate_every=0, **EVAL_FIELDS)
    for name in ("unet.safetensors", "ema.safetensors"):
        ours, theirs = (load_file(r / "checkpoints" / sd.run_folder.step_dir_name(4) / name) for r in (run, plain))
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), name
    losses = [[json.loads(line)["loss"] for line in (r / "metrics.jsonl").read_text().splitlines()] for r in (run, plain)]
    assert losses[0] == losses[1]


@pytest.mark.slow
@pytest.mark.parametrize("metric", ["fid", "clip_score"])
def test_keep_best_keeps_the_checkpoint_of_the_best_evaluation_through_pruning_and_a_resume(
        metric, reference, tmp_path, caplog):
    """Evaluated at every step, saved every 100 (so only the best's forced saves, the stop and the end),
    keeping 2, stopped at step 3 and resumed to 6: best.json names the step of the lowest logged FID (highest
    CLIP score), its checkpoint is still there, the log said so, and SD_ImageGen.py --best writes the very
    weights of that checkpoint."""
    import logging

    from safetensors.torch import load_file

    import SD_ImageGen
    import SD_Train
    from data_factory import make_dataset
    from sd.train.config import TrainConfig

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"a {c} {s}\n" for s in SHAPES for c in COLOURS))
    data = make_dataset(tmp_path / "data", n_train=32, n_val=0)
    fields = dict(datasets=[data], unet="tiny", vae="tiny", text_encoder="tiny", precision="fp32", device="cpu",
                  grad_checkpointing=False, batch_size=8, grad_accum=1, lr=3e-3, out_dir=str(tmp_path / "run"),
                  validation_data_captions=0, seed=5, max_steps=6, warmup_steps=1, ema_decay=0.5, save_steps=100,
                  keep_checkpoints=2, log_every=1, validate_every=0, eval_every=1, eval_prompts=str(prompts),
                  eval_reference=str(reference), keep_best=metric, **EVAL_FIELDS)
    run = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="sd_train"):
        for stop in (3, 0):
            config = TrainConfig(**fields, stop_at_step=stop)
            config.validate()
            assert SD_Train.train(config, Dist.single()) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    scores = {r["step"]: r[f"eval_{metric}"] for r in records if f"eval_{metric}" in r}
    assert sorted(scores) == [1, 2, 3, 4, 5, 6] and len(set(scores.values())) > 1
    pick = min if metric == "fid" else max
    best_step = next(step for step in sorted(scores) if scores[step] == pick(scores.values()))  # the first such
    best = json.loads((run / "best.json").read_text())
    assert best == {"metric": metric, "step": best_step, "value": scores[best_step],
                    "checkpoint": f"checkpoints/{sd.run_folder.step_dir_name(best_step)}"}
    improved = [s for s in sorted(scores) if scores[s] == pick(v for k, v in scores.items() if k <= s)
                and all(scores[k] != scores[s] for k in scores if k < s)]  # each step that beat every earlier one
    saved = sorted({*improved, 3, 6})
    left = [step for step, _ in sd.run_folder.complete_checkpoints(run / "checkpoints")]
    assert left == sorted({*saved[-2:], best_step})
    assert f"step {best_step}: the best {metric} so far" in caplog.text

    out = tmp_path / "exports"
    assert SD_ImageGen.main(["--ckpt", str(run), "--best", "--export_single_file", str(out / "best.safetensors")]) == 0
    assert SD_ImageGen.main(["--ckpt", str(run / best["checkpoint"]), "--export_single_file",
                             str(out / "folder.safetensors")]) == 0
    a, b = load_file(out / "best.safetensors"), load_file(out / "folder.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
