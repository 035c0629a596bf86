"""pipeline/01g_draw_pairs.py on a tiny model: K images per prompt drawn, resumed per prompt, scored by a function,
by CLIP or by the user's answers, and ranked into preference-pair shards; demo/evaluate.py's preference oracle."""

import importlib
import io
import json
import shutil

import numpy as np
import pytest
from PIL import Image

import sd.data.preference as preference
import sd.data.shards
import sd.evaluation
import sd.sampling

from data_factory import make_base_pipeline

STAGE = importlib.import_module("pipeline.01g_draw_pairs")
PROMPTS = ["a red circle", "a blue square", "a green triangle"]
K = 3


def brightness(images, prompts):
    """A scorer entry point: the mean grey level of each image."""
    return [float(np.asarray(image, np.float64).mean()) for image in images]


def raises(images, prompts):
    raise RuntimeError("the scorer broke")


def one_short(images, prompts):
    return brightness(images, prompts)[:-1]


def not_finite_for_blue(images, prompts):
    return [float("nan") if "blue" in prompt else 1.0 for prompt in prompts]


BRIGHTNESS = f"{__name__}:brightness"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("draw_pairs")
    make_base_pipeline(root / "model")
    (root / "prompts.txt").write_text("".join(p + "\n" for p in PROMPTS))
    return root


def run(inputs, out, *flags) -> int:
    return STAGE.main(["--model", str(inputs / "model"), "--prompts", str(inputs / "prompts.txt"), "--out", str(out),
                       "--per_prompt", str(K), "--steps", "2", "--width", "32", "--height", "32", "--device", "cpu",
                       "--batch_size", "4", *flags])


def files(folder):
    """Every file under ``folder``: its bytes and modification time."""
    return {p.relative_to(folder): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))
            if p.is_file()}


@pytest.fixture(scope="module")
def drawn(inputs):
    """The draw folder: its first prompt drawn by a run cut short (--max_prompts 1), the rest by the same command
    run again; what the first run wrote, kept for the test that checks the resume left it alone."""
    out = inputs / "drawn"
    assert run(inputs, out, "--scorer", BRIGHTNESS, "--max_prompts", "1") == 0
    first = files(out / "candidates")
    assert [r["index"] for r in preference.read_candidates(out)] == [0] and len(first) == K
    assert run(inputs, out, "--scorer", BRIGHTNESS) == 0
    return out, first


def copy(drawn, tmp_path):
    return shutil.copytree(drawn[0], tmp_path / "copy")  # copy2: the files keep their modification times


def pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def shard_samples(out):
    return [s for tar in sorted((out / "shards").glob("*.tar")) for s in sd.data.shards.read_shard(tar.read_bytes())[0]]


def test_a_cut_short_draw_resumes_and_a_rerun_draws_nothing(inputs, drawn, tmp_path, monkeypatch):
    out, first = drawn
    records = preference.read_candidates(out)
    assert [(r["index"], r["prompt"], r["seeds"]) for r in records] == \
        [(i, p, [i * K + k for k in range(K)]) for i, p in enumerate(PROMPTS)]
    assert records[1]["images"] == ["candidates/000001_0.png", "candidates/000001_1.png", "candidates/000001_2.png"]
    assert {key: records[0][key] for key in ("sampler", "steps", "cfg", "width", "height")} == \
        {"sampler": "ddim", "steps": 2, "cfg": 7.5, "width": 32, "height": 32}
    now = files(out / "candidates")
    assert {name: now[name] for name in first} == first  # the resume left the first prompt's images alone
    # Seeds are per image: the uninterrupted draw (other batches) makes the same pictures, to a grey level.
    assert run(inputs, tmp_path / "straight", "--scorer", BRIGHTNESS) == 0
    straight = files(tmp_path / "straight" / "candidates")
    assert straight.keys() == now.keys()
    assert max(np.abs(pixels(straight[n][0]).astype(int) - pixels(now[n][0])).max() for n in now) <= 1
    assert len({now[n][0] for n in now}) == len(now)  # and they are nine different pictures
    # The same command again loads no model and leaves every drawn file and every score as it was.
    again = copy(drawn, tmp_path)
    before = {**files(again / "candidates"), **{name: (again / name).read_bytes() for name in
                                                 ("candidates.jsonl", "scores.jsonl")}}
    monkeypatch.setattr(STAGE, "load_model", lambda *a: pytest.fail("a model was loaded"))
    assert run(inputs, again, "--scorer", BRIGHTNESS) == 0
    assert {**files(again / "candidates"), **{name: (again / name).read_bytes() for name in
                                               ("candidates.jsonl", "scores.jsonl")}} == before


def test_best_worst_pairs_hold_the_highest_scored_image_over_the_lowest(drawn):
    out, _ = drawn
    samples = shard_samples(out)
    assert len(samples) == len(PROMPTS)
    for sample, record in zip(samples, preference.read_candidates(out)):
        scores = brightness([pixels((out / name).read_bytes()) for name in record["images"]], [])
        best, worst = int(np.argmax(scores)), int(np.argmin(scores))
        assert sample.key == f"{record['index']:06d}_{best}_{worst}" and sample.caption == record["prompt"]
        preferred, rejected = pixels(sample.image), pixels(sample.rejected)
        assert brightness([preferred], [])[0] == max(scores) > min(scores) == brightness([rejected], [])[0]
        meta = json.loads(sample.metadata)
        assert meta["scorer"] == BRIGHTNESS and meta["index"] == record["index"]
        assert meta["preferred"] == {"image": record["images"][best], "seed": record["seeds"][best],
                                     "score": pytest.approx(max(scores))}
        assert meta["rejected"] == {"image": record["images"][worst], "seed": record["seeds"][worst],
                                    "score": pytest.approx(min(scores))}
    assert json.loads((out / "shards" / "00000_stats.json").read_text())["successes"] == len(PROMPTS)


def test_all_pairs_skip_and_count_ties_within_the_gap_and_stale_shards_go(inputs, drawn, tmp_path):
    out = copy(drawn, tmp_path)
    scores = {r["index"]: r["scores"] for r in preference.read_lines(out / "scores.jsonl")}
    gaps = sorted(abs(s[a] - s[b]) for s in scores.values() for a in range(K) for b in range(a + 1, K))
    assert run(inputs, out, "--scorer", BRIGHTNESS, "--pairs", "all", "--shard_size", "2") == 0
    assert len(shard_samples(out)) == 9 and len(list((out / "shards").glob("*.tar"))) == 5
    gap = gaps[4]  # five of the nine pairs are within it
    assert run(inputs, out, "--scorer", BRIGHTNESS, "--pairs", "all", "--shard_size", "2", "--min_gap", str(gap)) == 0
    expected = {f"{i:06d}_{a}_{b}" if s[a] > s[b] else f"{i:06d}_{b}_{a}" for i, s in scores.items()
                for a in range(K) for b in range(a + 1, K) if abs(s[a] - s[b]) > gap}
    assert {sample.key for sample in shard_samples(out)} == expected and len(expected) == 4
    assert sorted(p.name for p in (out / "shards").iterdir()) == ["00000.tar", "00000_stats.json", "00001.tar",
                                                                  "00001_stats.json", "01g_draw_pairs_summary.json"]
    summary = json.loads((out / "shards" / "01g_draw_pairs_summary.json").read_text())
    assert (summary["kept"], summary["dropped"], summary["pairs"]) == (4, {"tie": 5}, "all")


def test_user_answers_make_exactly_the_pairs_answered_a_or_b(inputs, drawn, tmp_path, capsys):
    out = copy(drawn, tmp_path)
    lines = [(0, 0, 1, "a"), (0, 0, 2, "b"), (0, 1, 2, "tie"), (1, 0, 1, "skip"), (1, 0, 2, "a"), (2, 1, 2, "a"),
             (1, 0, 2, "b")]  # the last answer to a question wins
    text = "".join(json.dumps({"index": i, "a": a, "b": b, "choice": c, "at": "2026-01-01T00:00:00+00:00"}) + "\n"
                   for i, a, b, c in lines)
    (out / "choices.jsonl").write_text(text + '{"index": 2, "a": 0, "b": 1, "choice": "a"')  # cut off: no answer
    capsys.readouterr()
    assert run(inputs, out, "--scorer", "user") == 0
    said = capsys.readouterr().out
    assert "3 of 9 questions are not answered yet" in said and "Prefer" in said and "SD_Studio.py" in said
    samples = shard_samples(out)
    assert [s.key for s in samples] == ["000000_0_1", "000000_2_0", "000001_2_0", "000002_1_2"]
    assert json.loads(samples[1].metadata)["answer"] == {"a": 0, "b": 2, "choice": "b"}
    assert "score" not in json.loads(samples[1].metadata)["preferred"]
    assert samples[1].image == (out / "candidates" / "000000_2.png").read_bytes()
    assert samples[1].rejected == (out / "candidates" / "000000_0.png").read_bytes()
    summary = json.loads((out / "shards" / "01g_draw_pairs_summary.json").read_text())
    assert summary["dropped"] == {"skip": 1, "tie": 1, "unanswered": 3}
    # An answer given after the cut-off line (the studio's append_choice) counts, and the cut-off line stays none.
    preference.append_choice(out, 2, 0, 1, "b")
    assert run(inputs, out, "--scorer", "user") == 0
    assert "2 of 9 questions are not answered yet" in capsys.readouterr().out
    assert [s.key for s in shard_samples(out)][-2:] == ["000002_1_0", "000002_1_2"]
    with pytest.raises(SystemExit) as exit_info:
        run(inputs, out, "--scorer", "user", "--pairs", "all")
    assert exit_info.value.code == 2 and "does not apply to --scorer user" in capsys.readouterr().err


@pytest.mark.parametrize("scorer, said, failed", [
    (f"{__name__}:raises", f"--scorer {__name__}:raises failed on prompt 0 ('a red circle'): RuntimeError: the "
                           "scorer broke", 0),
    (f"{__name__}:one_short", "returned 2 scores for the 3 images of prompt 0 ('a red circle')", 0),
    (f"{__name__}:not_finite_for_blue", "an image of prompt 1 ('a blue square') a score that is not finite", 1),
    ("no_such_scorer_module:score", "--scorer no_such_scorer_module:score: cannot import no_such_scorer_module "
                                    "(ModuleNotFoundError", 0),
    (f"{__name__}:nothing", f"{__name__} has no function nothing", 0),
])
def test_a_scorer_that_fails_stops_the_stage_with_one_line(inputs, drawn, tmp_path, capsys, scorer, said, failed):
    out = copy(drawn, tmp_path)
    capsys.readouterr()
    assert run(inputs, out, "--scorer", scorer) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("01g_draw_pairs.py: error: --scorer ") and said in last, last
    # The prompts scored before the failing one keep their scores (a re-run goes on from them); no later one has any.
    kept = [r["index"] for r in preference.read_lines(out / "scores.jsonl") if r["scorer"] == scorer]
    assert kept == list(range(failed))


def test_changed_drawing_settings_or_prompts_are_refused_naming_them(inputs, drawn, tmp_path, capsys):
    out = copy(drawn, tmp_path)
    capsys.readouterr()
    assert run(inputs, out, "--scorer", BRIGHTNESS, "--steps", "3") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "holds images drawn with --steps 2, not 3" in err
    (tmp_path / "other.txt").write_text("a red circle\na purple square\n")
    assert STAGE.main(["--model", str(inputs / "model"), "--prompts", str(tmp_path / "other.txt"), "--out", str(out),
                       "--per_prompt", str(K), "--steps", "2", "--width", "32", "--height", "32"]) == 2
    err = capsys.readouterr().err.strip()
    assert "prompt 1 was drawn as 'a blue square'" in err and "'a purple square'" in err


def test_the_clip_scorer_is_sd_eval_s_and_switching_scorers_keeps_both(inputs, drawn, tmp_path):
    out = copy(drawn, tmp_path)
    assert run(inputs, out, "--scorer", "clip", "--clip_model", "tiny") == 0
    lines = preference.read_lines(out / "scores.jsonl")
    clip = {r["index"]: r["scores"] for r in lines if r["scorer"] == "clip:tiny"}
    assert len(lines) == 2 * len(PROMPTS) and sorted(clip) == [0, 1, 2]
    extractors = sd.evaluation.Extractors("tiny", "tiny")
    for record in preference.read_candidates(out):
        images = [pixels((out / name).read_bytes()) for name in record["images"]]
        expected = extractors.clip_scores(images, [record["prompt"]] * K)
        assert np.allclose(clip[record["index"]], expected, rtol=1e-6)
    assert max(max(scores) for scores in clip.values()) > 0  # the stand-in's scores are not all clamped to 0
    before = (out / "scores.jsonl").read_bytes()
    assert run(inputs, out, "--scorer", BRIGHTNESS) == 0  # back to brightness: nothing scored again
    assert (out / "scores.jsonl").read_bytes() == before
    assert json.loads(shard_samples(out)[0].metadata)["scorer"] == BRIGHTNESS


def test_help_names_every_sampler_and_the_default_clip(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")
    text = STAGE.build_parser().format_help()
    assert all(f" {name}," in text or f" {name})" in text for name in sd.sampling.SAMPLERS)
    assert sd.evaluation.DEFAULT_CLIP_MODEL in text


def test_the_demo_oracle_prefers_the_prompted_colour_then_the_prompted_shape():
    from demo import evaluate

    stage00 = importlib.import_module("pipeline.00_make_demo_data")

    def drawing(colour, shape, seed):
        return stage00.draw_shape(colour, shape, 64, np.random.default_rng(seed))[0]

    prompt = "a red circle on a white background"
    right, wrong_shape, wrong_colour, other_right = (drawing("red", "circle", 0), drawing("red", "square", 0),
                                                     drawing("blue", "circle", 0), drawing("red", "circle", 1))
    scores = evaluate.preference_score([right, wrong_shape, wrong_colour, other_right], [prompt] * 4)
    assert [int(s) for s in scores] == [2, 1, 1, 2]
    assert scores[0] > scores[1] > scores[2] and scores[0] != scores[3]  # the share term: rarely a tie
    assert all(0 <= s - int(s) < 1 for s in scores)
    with pytest.raises(ValueError, match="names no colour"):
        evaluate.preference_score([right], ["a photo of a cat"])
