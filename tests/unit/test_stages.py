"""sd.data.stages, the stage contract: downloads, archive safety, image samples, shards with their done markers, the
skip rules of an import, and every stage's command line on it."""

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import sd.data.shards
import sd.data.stages

from http_server import LoopbackServer
from shard_factory import image_bytes, random_image


def test_download_retries_transient_errors_and_fails_fast_on_404(tmp_path):
    with LoopbackServer({"/a.bin": b"x" * 5000, "/flaky": b"y"},
                        failures={"/a.bin": [503, 500], "/flaky": [503, 502, 503]}) as server:
        path = sd.data.stages.download(f"{server.url}/a.bin", tmp_path / "a.bin", backoff=0.01)
        assert path.read_bytes() == b"x" * 5000 and server.hits["/a.bin"] == 3
        sd.data.stages.download(f"{server.url}/a.bin", tmp_path / "a.bin", backoff=0.01)
        assert server.hits["/a.bin"] == 3  # complete files are never fetched again
        with pytest.raises(sd.data.stages.DownloadError, match="HTTP 404"):
            sd.data.stages.download(f"{server.url}/missing", tmp_path / "m.bin", backoff=0.01)
        assert server.hits["/missing"] == 1 and not (tmp_path / "m.bin").exists()
        with pytest.raises(sd.data.stages.DownloadError, match="gave up after 3 tries"):
            sd.data.stages.download(f"{server.url}/flaky", tmp_path / "f.bin", retries=2, backoff=0.01)
        assert server.hits["/flaky"] == 3 and not (tmp_path / "f.bin").exists()


def test_hf_token_goes_to_the_hub_only_and_a_gated_file_without_it_says_what_to_do(tmp_path, monkeypatch):
    with LoopbackServer({"/file": b"cdn bytes"}) as cdn, LoopbackServer(
            {"/gated": b"gated bytes"}, token="hf_secret") as hub:
        hub.redirects["/resolve"] = cdn.url.replace("127.0.0.1", "localhost") + "/file"  # another host
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        with pytest.raises(sd.data.stages.DownloadError) as error:
            sd.data.stages.download(hub.url + "/gated", tmp_path / "a", retries=3, backoff=0)
        assert "HTTP 401 (a gated or private file" in str(error.value) and "export HF_TOKEN=" in str(error.value)
        assert hub.hits["/gated"] == 1  # not retried
        monkeypatch.setenv("HF_TOKEN", "hf_secret")
        assert sd.data.stages.download(hub.url + "/gated", tmp_path / "b").read_bytes() == b"gated bytes"
        assert sd.data.stages.download(hub.url + "/resolve", tmp_path / "c").read_bytes() == b"cdn bytes"
        assert hub.authorization["/resolve"] == ["Bearer hf_secret"]
        assert cdn.authorization["/file"] == [None]  # the redirect to the CDN did not carry it
        sd.data.stages.download(cdn.url + "/file", tmp_path / "d")  # nor does any other host get it
        assert cdn.authorization["/file"] == [None, None]
        cdn.failures["/private"] = [403]
        with pytest.raises(sd.data.stages.DownloadError) as error:  # not the hub: no advice about its token
            sd.data.stages.download(cdn.url + "/private", tmp_path / "e", retries=0)
        assert str(error.value).endswith("/private: HTTP 403")


def test_download_resumes_a_partial_file(tmp_path):
    body = bytes(range(256)) * 40
    (tmp_path / "b.bin.part").write_bytes(body[:1000])
    with LoopbackServer({"/b.bin": body}) as server:
        sd.data.stages.download(f"{server.url}/b.bin", tmp_path / "b.bin")
    assert (tmp_path / "b.bin").read_bytes() == body and not (tmp_path / "b.bin.part").exists()


def test_archive_member_paths_stay_inside_the_target(tmp_path):
    for name in ("images/a.jpg", "a.jpg", "./x/y.png"):
        assert sd.data.stages.is_safe_member(name)
        assert tmp_path in sd.data.stages.safe_extract_path(tmp_path, name).parents
    for name in ("../evil.jpg", "x/../../evil.jpg", "/etc/passwd", "C:/x.jpg", "..\\evil.jpg", ""):
        assert not sd.data.stages.is_safe_member(name)
        with pytest.raises(ValueError, match="unsafe"):
            sd.data.stages.safe_extract_path(tmp_path, name)


def test_parse_range():
    assert sd.data.stages.parse_range("1-3,7, 2") == [1, 2, 3, 7]
    for bad in ("3-1", "a", "1-x"):
        with pytest.raises(ValueError):
            sd.data.stages.parse_range(bad)


def test_image_sample_is_a_square_jpeg_with_metadata():
    data = image_bytes(random_image(np.random.default_rng(0), 300, 200), "PNG")
    sample = sd.data.stages.image_sample("k1", data, "png", "a cat", 64, {"source": "test"})
    rgb = sd.data.shards.decode_image(sample.image, "jpg")
    assert rgb.shape == (64, 64, 3) and sample.caption == "a cat" and sample.image_ext == "jpg"
    meta = json.loads(sample.metadata)
    assert (meta["original_width"], meta["original_height"], meta["source"]) == (200, 300, "test")
    with pytest.raises(sd.data.shards.ImageSkip):
        sd.data.stages.image_sample("k2", b"not an image\xff\xd9", "jpg", "x", 64)


@pytest.mark.parametrize("caption, size, reason", [
    (None, (8, 8), "bad_caption_encoding"), ("", (100_000, 1), "no_caption"), (None, None, "bad_caption_encoding"),
    ("", None, "no_caption"), ("a cat", (300, 300), "too_large"), ("a cat", (1000, 100), "too_large"),
    ("a cat", (200, 10), "extreme_aspect"), ("a cat", (15, 40), "too_small"), ("a cat", (16, 128), None),
    ("a cat", None, None)])
def test_the_skip_rules_of_an_import_answer_in_their_order(caption, size, reason):
    """01e's five rules (and the studio's scan): the caption's before the size's, the first that refuses names it;
    without a size, the caption's alone."""
    try:
        sd.data.stages.check_import(caption, size, min_size=16, max_pixels=250 * 250)
    except sd.data.shards.ImageSkip as skip:
        assert skip.reason == reason
    else:
        assert reason is None


def test_write_shard_marks_done_last_and_summary_adds_up(tmp_path):
    stats = sd.data.stages.ShardStats()
    stats.skip("undecodable", "bad.jpg")
    samples = [sd.data.shards.ShardSample("k0", b"\xff\xd8\xff\xd9", "jpg", "c", b"{}")]
    record = sd.data.stages.write_shard(tmp_path, 3, samples, stats, source="x")
    assert sd.data.stages.output_done(tmp_path, 3) and not sd.data.stages.output_done(tmp_path, 2)
    assert record == {"count": 2, "successes": 1, "failed": {"undecodable": 1},
                      "examples": {"undecodable": ["bad.jpg"]}, "source": "x"}
    read, truncated = sd.data.shards.read_shard((tmp_path / "00003.tar").read_bytes())
    assert truncated is None and [s.key for s in read] == ["k0"]
    summary = sd.data.stages.Summary("test")
    summary.add_done(tmp_path / "00003_stats.json")
    result = summary.finish(tmp_path)
    assert (result["kept"], result["dropped"], result["shards_already_done"]) == (1, {"undecodable": 1}, 1)
    assert json.loads((tmp_path / "test_summary.json").read_text())["kept"] == 1


def test_write_shard_skips_and_counts_a_key_no_reader_can_trust(tmp_path):
    samples = [sd.data.shards.ShardSample(key, b"\xff\xd8\xff\xd9", "jpg", "c", b"{}")
               for key in ("k0", "line\u2028sep", "k1")]
    record = sd.data.stages.write_shard(tmp_path, 0, samples, sd.data.stages.ShardStats())
    assert record == {"count": 3, "successes": 2, "failed": {"bad_key": 1}, "examples": {"bad_key": ["line\u2028sep"]}}
    read, _ = sd.data.shards.read_shard((tmp_path / "00000.tar").read_bytes())
    assert [s.key for s in read] == ["k0", "k1"]


def test_pending_counts_finished_outputs_and_returns_the_rest_in_order(tmp_path):
    for name, successes in (("b", 3), ("d", 5)):
        stats = sd.data.stages.ShardStats()
        stats.successes = successes
        stats.skip("no_caption", f"{name}0")
        sd.data.stages.write_output(tmp_path, name, lambda tmp: Path(tmp).write_text("rows"), stats, ".parquet")
    (tmp_path / "c.parquet").write_text("no stats file: not done")
    summary = sd.data.stages.Summary("test")
    assert summary.pending(tmp_path, ["a", "b", "c", "d"], ".parquet") == ["a", "c"]
    assert (summary.kept, summary.dropped, summary.shards_skipped) == (8, {"no_caption": 2}, 2)
    assert json.loads((tmp_path / "b_stats.json").read_text())["count"] == 4


# ---------------------------------------------------------------------------------------------
# The stage contract: every numbered stage
# ---------------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
STAGES = sorted(path.stem for path in (ROOT / "pipeline").glob("0*.py"))


def stage(name: str):
    return importlib.import_module(f"pipeline.{name}")


def help_entries(name: str, capsys) -> dict[str, str]:
    """flag -> its --help text on one line."""
    with pytest.raises(SystemExit) as exit_info:
        stage(name).main(["--help"])
    assert exit_info.value.code == 0
    options = capsys.readouterr().out.split("options:")[1]
    return {entry.split()[0].rstrip(","): " ".join(entry.split())
            for entry in re.split(r"\n  (?=-)", options) if entry.strip()}


def test_the_stages_are_these():
    assert STAGES == ["00_make_demo_data", "01_download_metadata", "01b_download_diffusiondb",
                      "01c_download_journeydb_images", "01d_download_coco", "01e_import_folder",
                      "01f_import_pairs", "01g_draw_pairs", "02_filter_metadata", "03_download_images", "03b_derive_control", "03c_caption_images",
                      "04_preprocess_to_cache", "05_build_hf_dataset"]


@pytest.mark.parametrize("name", STAGES)
def test_every_stage_spells_shared_flags_one_way_with_one_default(name, capsys):
    entries = help_entries(name, capsys)
    assert entries["--out"].endswith("(required)")
    assert not {"--shards", "--src", "--dtype"} & set(entries)  # old spellings are hidden aliases
    if "--workers" in entries:
        assert entries["--workers"] == (f"--workers WORKERS threads decoding and resizing images "
                                        f"(default: {sd.data.stages.DEFAULT_WORKERS})")
    if "--retries" in entries:
        assert entries["--retries"].endswith(f"(default: {sd.data.stages.DEFAULT_RETRIES})")
    if "--resolution" in entries:  # pairs keep their images as they come unless asked (encode_latents.py scales)
        assert entries["--resolution"].endswith("(default: 0)" if name == "01f_import_pairs" else "(default: 512)")
    downloads = name in ("01b_download_diffusiondb", "01c_download_journeydb_images", "01d_download_coco")
    decodes = downloads or name in ("03b_derive_control", "01f_import_pairs")
    assert ("--workers" in entries, "--retries" in entries) == (decodes, downloads or name == "03_download_images")
    single_input = name in ("01e_import_folder", "01f_import_pairs", "02_filter_metadata", "03_download_images", "03b_derive_control",
                            "03c_caption_images", "04_preprocess_to_cache")
    assert ("--input" in entries) == single_input


@pytest.mark.parametrize("name, argv, flag", [
    ("04_preprocess_to_cache", ["--input", "x/*.tar", "--out", "o", "--tok", "tiny"], "--tok tiny"),
    ("01e_import_folder", ["--input", "x", "--out", "o", "--lay", "flat"], "--lay flat"),
])
def test_an_abbreviated_flag_is_refused_in_one_line(name, argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        stage(name).main(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"{name}.py: error: unrecognized arguments: {flag} (see --help)\n"


BOOL_FORMS = [([], False), (["FLAG"], True), (["FLAG", "true"], True), (["FLAG", "false"], False),
              (["FLAG", "1"], True), (["FLAG", "no"], False)]


@pytest.mark.parametrize("form, expected", BOOL_FORMS)
def test_a_boolean_flag_reads_the_same_in_two_stages(tmp_path, form, expected):
    flag = [word.replace("FLAG", "--keep_archives") for word in form]
    diffusiondb = stage("01b_download_diffusiondb").parse_args(["--parts", "1", "--out", str(tmp_path), *flag])
    assert diffusiondb.keep_archives is expected
    # Followed by another flag, a bare boolean still takes no value.
    trailing = stage("01b_download_diffusiondb").parse_args(["--parts", "1", *flag, "--out", str(tmp_path)])
    assert trailing.keep_archives is expected and trailing.out == str(tmp_path)
    flag = [word.replace("FLAG", "--score_tags") for word in form]
    args, rules = stage("01e_import_folder").parse_args(["--input", str(tmp_path), "--out", str(tmp_path / "o"),
                                                         "--layout", "metadata", *flag])
    assert args.score_tags is expected and rules.score_tags is expected


def test_a_boolean_flag_refuses_other_words(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        stage("01b_download_diffusiondb").parse_args(["--parts", "1", "--out", str(tmp_path), "--keep_archives", "maybe"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ("01b_download_diffusiondb.py: error: argument --keep_archives: expected true "
                                       "or false, got 'maybe' (see --help)\n")


@pytest.mark.parametrize("name, old, extra", [
    ("04_preprocess_to_cache", "--shards", []),
    ("01e_import_folder", "--src", []),
])
def test_the_old_input_spelling_is_an_alias(tmp_path, name, old, extra, capsys):
    parsed = stage(name).parse_args([old, str(tmp_path), "--out", str(tmp_path / "o"), *extra])
    args = parsed[0] if isinstance(parsed, tuple) else parsed
    assert args.input == str(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        stage(name).parse_args(["--out", str(tmp_path / "o")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"{name}.py: error: the following arguments are required: --input (see --help)\n"


@pytest.mark.slow
def test_every_stage_runs_as_a_script_from_any_folder(tmp_path):
    """``python pipeline/NN_x.py --help`` from outside the repository (the tests of each stage run it
    from the repository root): the scripts find the repository's modules by their own path."""
    runs = [(name, cwd, subprocess.Popen([sys.executable, str(ROOT / "pipeline" / f"{name}.py"), "--help"], cwd=cwd,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            for name in STAGES for cwd in [tmp_path]]
    for name, cwd, process in runs:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, (name, cwd, err[-2000:])
        assert out.startswith(f"usage: {name}.py ") and "--out OUT" in out


def test_the_stages_before_tokenizing_start_without_torch():
    """Stages 00-03 compute nothing with torch, and importing it would be 2.5 s of each start-up: their
    modules and ``main`` up to the end of --help leave it (and the model libraries) unimported."""
    code = ("import contextlib, importlib, io, sys\n"
            "for name in sys.argv[1:]:\n"
            "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
            "        importlib.import_module(f'pipeline.{name}').main(['--help'])\n"
            "print(sorted(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules))")
    names = [name for name in STAGES if name < "04"]
    result = subprocess.run([sys.executable, "-c", code, *names], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", (result.stdout, result.stderr[-2000:])


@pytest.mark.parametrize("script", ["encode_latents", "train_vae"])
def test_shard_readers_take_the_data_stages_spelling_input_too(script):
    module = importlib.import_module(script)
    required = {"encode_latents": ["--out", "o", "--vae", "tiny"], "train_vae": ["--out", "o"]}[script]
    assert module.parse_args(["--input", "a/*.tar", *required]).shards == "a/*.tar"
    assert module.parse_args(["--shards", "a/*.tar", *required]).shards == "a/*.tar"


@pytest.mark.parametrize("name, argv, changed, recorded", [
    ("00_make_demo_data", ["--count", "8"], ["--size", "32"], "--size 64"),
    ("01b_download_diffusiondb", ["--parts", "1"], ["--resolution", "256"], "--resolution 512"),
    ("01c_download_journeydb_images", ["--archives", "0", "--annotations", "ANN"], ["--caption", "caption"],
     "--caption 'prompt'"),
    ("01d_download_coco", ["--images", "IMG", "--captions", "ANN"], ["--shard_size", "10"], "--shard_size 1000"),
    ("03_download_images", ["--input", "IMG"], ["--keep_aspect"], "--keep_aspect None"),
])
def test_a_rerun_with_other_output_shaping_flags_stops_before_any_work(tmp_path, name, argv, changed, recorded,
                                                                        capsys):
    (tmp_path / "ann.jsonl").write_text("")
    (tmp_path / "img").mkdir()
    argv = [{"ANN": str(tmp_path / "ann.jsonl"), "IMG": str(tmp_path / "img")}.get(a, a) for a in argv]
    out = tmp_path / "out"
    def parse(*more):
        args = stage(name).parse_args([*argv, "--out", str(out), *more])
        sd.data.stages.keep_settings(args)  # what the stage does before its first output

    parse()
    assert not (out / f"{name}_stats.json").exists() and (out / f"{name}.settings").exists()
    parse(*changed)  # nothing finished yet: the new values are taken
    parse()
    (out / "00000_stats.json").write_text("{}")  # a finished output
    parse()  # the same values: a resume
    with pytest.raises(SystemExit) as exit_info:
        parse(*changed)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{name}.py: {out} holds outputs made with {recorded}, not ") and err.count("\n") == 1
    assert "delete" in err and "another output folder" in err
    (out / f"{name}.settings").write_bytes(b"\x00{ damaged")  # a damaged record: one line naming it
    with pytest.raises(SystemExit) as exit_info:
        parse()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{name}.py: {out / (name + '.settings')} is unreadable") and err.count("\n") == 1
