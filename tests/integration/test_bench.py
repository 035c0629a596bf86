"""Every benchmark runs on the CPU with tiny models and prints its ratio against its peer."""

import contextlib
import importlib
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import sd.data.buckets
import sd.model

ROOT = Path(__file__).resolve().parents[2]


def run_bench(script: str, *args, own_process: bool = False) -> tuple[str, dict]:
    """``python bench/SCRIPT ARGS``: its printed output and the JSON line it ends with. Run in this
    process (its main, as the script's last line calls it) unless ``own_process``: a benchmark that
    reads its own process's memory needs a process of its own. The children a benchmark starts for
    its measurements are processes of their own either way."""
    if own_process:
        result = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
        return result.stdout, json.loads(lines[-1])
    module = importlib.import_module(f"bench.{Path(script).stem}")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = module.main(list(args))
    assert code in (0, None) or isinstance(code, dict), code
    lines = [line for line in printed.getvalue().splitlines() if line.startswith("{")]
    return printed.getvalue(), json.loads(lines[-1])


@pytest.mark.slow
def test_encode_latents_bench_prints_both_rates_and_the_ratio():
    stdout, result = run_bench("encode_throughput.py", "--images", "48", "--per_shard", "16", "--batch_size", "8")
    assert "ratio ours/naive" in stdout
    assert result["encoded"] == 48
    for key in ("ours_images_per_s", "naive_images_per_s", "vae_only_images_per_s"):
        assert result[key] > 0
    # the ratio of the unrounded rates; each of the three is printed to 2 decimals (half a unit: 0.005)
    ours, naive = result["ours_images_per_s"], result["naive_images_per_s"]
    rounding = 0.005 + ours / naive * (0.005 / ours + 0.005 / naive) * 1.01
    assert abs(result["ratio_vs_naive"] - ours / naive) <= rounding, (result, rounding)


@pytest.mark.slow
def test_train_throughput_bench_measures_ours_and_both_peers(tmp_path):
    stdout, result = run_bench("train_throughput.py", "--batch_sizes", "2", "--checkpointing", "0,1", "--steps", "2",
                               "--rounds", "2", "--peak_tflops", "1", "--json", str(tmp_path / "out.json"))
    assert result == json.loads((tmp_path / "out.json").read_text())
    rows = {(row["impl"], row["variant"]): row for row in result["rows"]}
    assert set(rows) == {("ours", "eager"), ("ours", "eager+checkpointing"), ("peer-unet", "diffusers step"),
                         ("peer-vae", "diffusers step")}
    assert result["flops_per_image"] == sd.model.training_flops_per_image("tiny", 8)
    for row in rows.values():
        assert row["batch"] == 2 and row["images_per_s"] > 0
        assert row["images_per_s"] == pytest.approx(2000 / row["step_ms"])
        assert row["mfu"] == pytest.approx(row["images_per_s"] * result["flops_per_image"] / 1e12)
    best = max(rows[("ours", "eager")]["images_per_s"], rows[("ours", "eager+checkpointing")]["images_per_s"])
    for peer in ("peer-unet", "peer-vae"):
        ratio = next(r["ratio"] for r in result["ratios"] if r["peer"] == peer)
        assert ratio == round(best / rows[(peer, "diffusers step")]["images_per_s"], 3)
        assert f"ratio ours/{peer} at batch 2 = {ratio:.2f}x" in stdout


@pytest.mark.slow
def test_train_throughput_bench_one_configuration_at_a_time():
    _, result = run_bench("train_throughput.py", "--batch_sizes", "3", "--peers", "", "--steps", "1", "--rounds", "1")
    [row] = result["rows"]
    assert (row["impl"], row["variant"], row["batch"]) == ("ours", "eager+checkpointing", 3)
    assert row["images_per_s"] > 0 and result["ratios"] == []


@pytest.mark.slow
def test_train_throughput_bench_rejects_unknown_variants():
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "train_throughput.py"), "--variants", "eager,jit"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "--variants: unknown ['jit']" in result.stderr


@pytest.mark.slow
def test_peer_script_inputs_load_as_a_diffusers_pipeline_and_an_imagefolder(tmp_path):
    import datasets
    import torch
    from diffusers import StableDiffusionPipeline

    from bench import train_throughput

    model_dir, data_dir = train_throughput.prepare_peer_inputs(tmp_path, "tiny", 64, images=5)
    pipeline = StableDiffusionPipeline.from_pretrained(str(model_dir), local_files_only=True)
    ours = sd.model.build_unet("tiny", seed=0).state_dict()  # the weights our side of the benchmark trains
    assert all(torch.equal(value, ours[name]) for name, value in pipeline.unet.state_dict().items())
    rows = datasets.load_dataset("imagefolder", data_dir=str(data_dir), split="train")
    assert len(rows) == 5 and rows.column_names == ["image", "text"]
    assert rows[3]["text"] == "a photograph number 3" and rows[3]["image"].size == (96, 80)
    command = train_throughput.peer_script_command("t2i.py", model_dir, data_dir, tmp_path / "out", 64, 4, 7, "bf16",
                                                   ["--rank", "8"])  # the LoRA script's extra flag
    flags = dict(zip(command[2::2], command[3::2]))
    assert flags["--train_batch_size"] == "4" and flags["--max_train_steps"] == "7" and flags["--rank"] == "8"
    assert flags["--mixed_precision"] == "bf16" and flags["--pretrained_model_name_or_path"] == str(model_dir)


def test_largest_batch_search_doubles_then_bisects():
    from bench import memory

    calls = []

    def trial(batch):  # 1 GB of weights and 0.25 GB per image; out of memory above 30 images
        calls.append(batch)
        return {"oom": True} if batch > 30 else {"peak_gb": 1 + 0.25 * batch}

    assert memory.largest_batch(trial, limit_gb=6.0, max_batch=512)[0] == 20
    assert calls == [1, 2, 4, 8, 16, 32, 24, 20, 22, 21]
    assert memory.largest_batch(trial, limit_gb=100.0, max_batch=512)[0] == 30
    assert memory.largest_batch(trial, limit_gb=100.0, max_batch=8)[0] == 8
    assert memory.largest_batch(trial, limit_gb=0.5, max_batch=8)[0] == 0


def test_the_measured_peak_is_the_most_bytes_live_at_once_in_the_record():
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench import memory_estimate

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        first = torch.empty(4000, dtype=torch.uint8)
        second = torch.empty(2000, dtype=torch.uint8)
        del first
        third = torch.empty(500, dtype=torch.uint8)  # 2500 bytes live now, 6000 before the del
    assert memory_estimate.peak_live_bytes(prof, torch.device("cpu")) == 6000
    del second, third


def test_a_block_freed_where_the_profiler_does_not_look_is_freed_when_its_address_is_handed_out_again():
    """A record (built by hand: which thread frees what is up to the allocator and the scheduler) where
    the block at address 1 is freed by an unprofiled thread: no free of it, then a new block at 1."""
    from types import SimpleNamespace

    import torch
    from torch._C._profiler import _EventType

    from bench import memory_estimate

    def event(microsecond, size, ptr, device=torch.device("cpu")):
        fields = SimpleNamespace(device=device, alloc_size=size, ptr=ptr)
        return SimpleNamespace(start_time_ns=microsecond * 1000, typed=(_EventType.Allocation, fields), children=[])

    def peak(*events):
        root = SimpleNamespace(name="", start_time_ns=0, typed=(None, None), children=list(events))
        prof = SimpleNamespace(profiler=SimpleNamespace(kineto_results=SimpleNamespace(
            experimental_event_tree=lambda: [root])))
        return memory_estimate.peak_live_bytes(prof, torch.device("cpu"))

    unseen_free = [event(1, 4000, 1), event(2, 500, 2), event(3, 4000, 1), event(4, -4000, 1), event(5, -500, 2)]
    assert peak(*unseen_free) == 4500  # not 8500: the first block at 1 was gone before the second
    # A free and an allocation at one address in the same instant: the free first, whatever the tree's order.
    assert peak(event(1, 1000, 1), event(2, -1000, 1), event(2, 3000, 1), event(3, 2000, 2)) == 5000
    assert peak(*unseen_free, event(6, 9000, 3, torch.device("meta"))) == 4500  # another device's
    # The free of a block made in an earlier record (its garbage collected in this one) is left out, as the block is.
    assert peak(event(1, -7000, 9), *unseen_free) == 4500


def test_a_block_made_in_an_earlier_record_is_not_counted_when_this_one_frees_it():
    import gc

    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench import memory_estimate

    class Cycle:  # freed by the garbage collector, not when its last name goes
        def __init__(self):
            self.me, self.block = self, torch.empty(1 << 20, dtype=torch.uint8)

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
        made_before = Cycle()
    del made_before
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        gc.collect()
        block = torch.empty(1 << 20, dtype=torch.uint8)
    assert memory_estimate.peak_live_bytes(prof, torch.device("cpu")) == 1 << 20
    del block


@pytest.mark.slow
def test_memory_bench_finds_the_largest_batch_of_ours_and_the_peer():
    # One trial a side (each is a process of its own): the search itself is sd.train.memory.largest_that_fits,
    # tested in tests/unit/test_sd_memory.py.
    stdout, result = run_bench("memory.py", "--checkpointing", "1", "--max_batch", "1", "--batch", "1",
                               own_process=True)
    rows = {row["impl"]: row for row in result["rows"]}
    assert set(rows) == {"ours", "peer"}
    for row in rows.values():
        assert row["largest_batch"] == 1 and row["capped"]  # the tiny model fits an image in 0.4 GB
        assert [t["batch"] for t in row["trials"]] == [1] and all(t["fits"] for t in row["trials"])
        assert 0.01 < row["peak_gb_at_batch"] < result["limit_gb"]
    ratio = result["ratios"][0]["peak_ratio_at_batch"]
    assert ratio == round(rows["ours"]["peak_gb_at_batch"] / rows["peer"]["peak_gb_at_batch"], 3)
    assert "ratio ours/peer with checkpointing: largest batch 1/1 = 1.0x" in stdout


@pytest.mark.slow
def test_sampling_bench_matches_the_diffusers_pipeline():
    stdout, result = run_bench("sampling.py", "--batch_sizes", "1,2", "--steps", "10", "--repeats", "1")
    assert [(r["impl"], r["batch"]) for r in result["rows"]] == [("ours", 1), ("peer", 1), ("ours", 2), ("peer", 2)]
    for compared in result["ratios"]:
        ours, peer = (r["it_per_s"] for r in result["rows"] if r["batch"] == compared["batch"])
        assert compared["ratio"] == round(ours / peer, 3)
        # the same DDIM on the same noise and weights: the same latents
        assert compared["max_abs_difference"] < 1e-3
    assert "ratio ours/peer eager at batch 2" in stdout


@pytest.mark.slow
def test_checkpoint_hash_bench_writes_real_shapes_and_times_both_hashes(tmp_path):
    stdout, result = run_bench("checkpoint_hash.py", "--scale", "0.001", "--dir", str(tmp_path))
    assert "hash/save" in stdout and "sha256/xxh3" in stdout
    assert 800_000 < result["parameters"] < 1_700_000  # 859.5M scaled by 0.001 along dim 0 (at least 1 each)
    assert result["bytes"] > 4 * 4 * result["parameters"]  # UNet + EMA + two moments, fp32
    assert result["save_s"] > 0 and result["xxh3_s"] > 0 and result["sha256_s"] > 0
    assert list(tmp_path.iterdir()) == []  # the files are removed


@pytest.mark.slow  # over 5 s: the full suite's (make check stays near 3 minutes)
def test_ema_copy_bench_times_both_paths_and_computes_the_sd1_transfer(capsys):
    from bench import ema_copy

    result = ema_copy.main(["--arch", "sd1", "--fraction", "0.001", "--rounds", "1", "--device", "cpu"])
    assert result["params_full"] == 859_520_964 and result["bytes_full"] == 3_438_083_856
    assert 0 < result["params_measured"] < 0.01 * result["params_full"]
    assert result["ours_s"] > 0 and result["previous_s"] > 0
    assert result["ours_s_full"] == pytest.approx(result["ours_s"] * 859_520_964 / result["params_measured"], rel=1e-2,
                                                    abs=1e-3)
    assert result["pcie_s_computed"] == {"PCIe 4.0 x16": 0.138, "PCIe 5.0 x16": 0.069}
    stdout = capsys.readouterr().out
    assert f"ratio ours/previous = {result['ratio_ours_vs_previous']:.2f}x" in stdout
    assert "computed, not measured: 3.44 GB over PCIe 4.0 x16 at 25 GB/s = 0.138 s" in stdout


@pytest.mark.slow
def test_latent_store_bench_compares_shared_and_private_memory(tmp_path):
    stdout, result = run_bench("latent_store.py", "--sizes", "512", "--shard_size", "128", "--batches", "2",
                               "--batch", "8", "--dir", str(tmp_path))
    [row] = result["rows"]
    assert row["latents"] == 512 and row["ranks"] == 2 and "projected to 1,300,000 latents" in stdout
    assert row["peer_rss_anon_mb"] > 1.5 * row["data_mb"]  # each of the two ranks holds a copy of 16 MB
    assert row["ours_rss_anon_mb"] < row["peer_rss_anon_mb"]
    assert row["storage_samples_per_s"] > 0


@pytest.mark.slow
def test_caption_scale_bench_compares_both_loads_and_the_three_stage_04_reads():
    stdout, result = run_bench("caption_scale.py", "--sizes", "3000", "--shard_sizes", "60", "--image_kb", "16")
    load = {row["way"]: row for row in result["caption_load"]}
    assert set(load) == {"per_row", "arrow"} and all(row["rows"] == 3000 and row["seconds"] > 0 for row in load.values())
    # speedup is rounded to 0.1 and the seconds to 10 us: the ratio of the rounded seconds is within 1% of it
    assert load["arrow"]["speedup"] == pytest.approx(load["per_row"]["seconds"] / load["arrow"]["seconds"], rel=0.01,
                                                     abs=0.051)
    reads = {row["way"]: row for row in result["stage04"]}
    assert list(reads) == ["previous: whole tar", "tar, headers only", "img2dataset parquet"]
    assert {row["samples_read"] for row in reads.values()} == {57}  # every 20th download failed
    if reads["previous: whole tar"]["read_mb"] >= 0:  # /proc/self/io is there (Linux)
        assert reads["previous: whole tar"]["read_mb"] >= reads["previous: whole tar"]["tar_mb"] - 0.1
        assert reads["tar, headers only"]["read_mb"] < reads["previous: whole tar"]["tar_mb"] / 3
        assert reads["img2dataset parquet"]["read_mb"] < reads["tar, headers only"]["read_mb"]
    assert "trainer caption load" in stdout and "stage 04 caption read" in stdout


@pytest.mark.slow
def test_data_scale_bench_measures_stage_02_and_its_peers_in_their_own_processes():
    stdout, result = run_bench("data_scale.py", "--stage", "02", "--sizes", "20000", "--files", "2",
                               "--memory_limit", "500MB", "--threads", "1")
    rows = {row["impl"]: row for row in result["stages"]["02"]["rows"]}
    assert set(rows) == {"ours", "previous", "duckdb-sql"}
    for row in rows.values():
        assert row["rows"] == 20_000 and row["cpu_s"] > 0 and row["peak_rss_gb"] > 0.05
        assert row["rows_per_cpu_s"] == pytest.approx(20_000 / row["cpu_s"])
    assert rows["ours"]["same_as_previous"] is True
    assert "ratio ours/previous" in stdout and "LAION-2B-en" in stdout


@pytest.mark.slow
def test_data_scale_bench_puts_another_stage_in_the_same_form_with_its_projection():
    stdout, result = run_bench("data_scale.py", "--stage", "encode", "--sizes", "8,24")
    rows = result["stages"]["encode"]["rows"]
    assert [(row["impl"], row["size"]) for row in rows] == [("ours", 8), ("ours", 24)]
    for row in rows:
        assert row["seconds"] > 0 and row["memory_mb"] > 50 and row["rate"] == pytest.approx(row["size"] / row["seconds"])
    [projection] = result["stages"]["encode"]["projected"]
    assert "10,000-image shard peaks at" in projection and f"projected: {projection}" in stdout
    assert "growth ours: size x3" in stdout


def test_lora_step_bench_times_ours_against_full_fine_tuning_and_the_peer(tmp_path):
    stdout, result = run_bench("lora_step.py", "--batch_sizes", "2", "--warmup", "0", "--timed_steps", "1",
                               "--threads", "1", "--estimate", "false", "--json", str(tmp_path / "out.json"))
    assert result == json.loads((tmp_path / "out.json").read_text())
    rows = {row["impl"]: row for row in result["rows"]}
    assert list(rows) == ["ours-lora", "ours-full", "peer-lora"]
    for row in rows.values():
        assert (row["batch"], row["setting"]) == (2, "adamw")
        assert row["images_per_s"] == pytest.approx(2000 / row["step_ms"])
    # rank 4 on the attention projections: the same adapter in ours and the peer, a sliver of the UNet
    assert rows["ours-lora"]["trainable_params"] == rows["peer-lora"]["trainable_params"]
    assert rows["ours-lora"]["trainable_params"] < 0.05 * rows["ours-full"]["trainable_params"]
    assert rows["ours-full"]["trainable_params"] == 803_204  # the tiny UNet
    [compared] = result["ratios"]
    for key, other in (("lora_vs_full_images_per_s", "ours-full"), ("lora_vs_peer_images_per_s", "peer-lora")):
        assert compared[key] == round(rows["ours-lora"]["images_per_s"] / rows[other]["images_per_s"], 3)
    assert compared["lora_vs_full_peak"] is None and compared["lora_vs_full_estimate"] is None  # CPU, no estimate
    peer_ratio = compared["lora_vs_peer_images_per_s"]
    assert f"ratio ours-lora/peer-lora at batch 2 (adamw): images/s {peer_ratio:.2f}x" in stdout


def test_lora_step_ratios_pair_each_lora_row_with_full_fine_tuning_and_the_peer_of_its_setting():
    from bench import lora_step

    cached = lora_step.Setting("adamw8bit", True, True)
    rows = [{"impl": "ours-lora", "batch": 4, "setting": cached.name, "images_per_s": 30.0, "estimate_gb": 2.0},
            {"impl": "ours-full", "batch": 4, "setting": cached.name, "images_per_s": 20.0, "estimate_gb": 8.0},
            {"impl": "peer-lora", "batch": 4, "setting": "adamw8bit+checkpointing", "images_per_s": 24.0,
             "peak_allocated_gb": 3.0},
            {"impl": "peer-lora", "batch": 8, "setting": "adamw8bit+checkpointing", "images_per_s": 1.0}]
    [compared] = lora_step.ratios(rows, [cached])
    assert compared == {"batch": 4, "setting": "adamw8bit+checkpointing+text_cache", "lora_vs_full_images_per_s": 1.5,
                        "lora_vs_full_peak": None, "lora_vs_full_estimate": 0.25, "lora_vs_peer_images_per_s": 1.25,
                        "lora_vs_peer_peak": None}


def test_dpo_step_bench_times_dpo_against_the_same_adapters_plain_step_at_b_and_2b_images(tmp_path):
    stdout, result = run_bench("dpo_step.py", "--smoke", "--whole_unet", "--device", "cpu",
                               "--json", str(tmp_path / "out.json"))
    assert result == json.loads((tmp_path / "out.json").read_text())
    assert (result["unet"], result["resolution"], result["pairs"], result["steps"], result["repeats"]) == (
        "tiny", 32, 2, 2, 1)
    rows = {row["name"]: row for row in result["rows"]}
    assert list(rows) == ["plain-lora B", "plain-lora 2B", "dpo-lora", "plain-whole B", "plain-whole 2B", "dpo-whole"]
    # B = 2 pairs: DPO runs 2B images with gradients and 2B more through the reference, without
    assert [(row["images_with_grad"], row["images_through_unet"]) for row in rows.values()] == [(2, 2), (4, 4),
                                                                                                (4, 8)] * 2
    # each DPO run starts as its reference (a LoRA's up-projection is zero, a whole UNet's copy is equal): the
    # logits are 0 and the first loss is -log sigmoid(0) = ln 2; the plain runs' first loss is an MSE
    for name, row in rows.items():
        assert (row["first_loss"] == pytest.approx(math.log(2), abs=1e-6)) == name.startswith("dpo")
    assert rows["plain-lora B"]["trainable_params"] == rows["dpo-lora"]["trainable_params"] == 11_008
    assert rows["plain-whole B"]["trainable_params"] == rows["dpo-whole"]["trainable_params"] == 803_204
    for row in rows.values():
        assert len(row["step_s"]) == 1 and row["step_ms"] == round(1000 * row["step_s"][0], 2) > 0
        assert "peak_allocated_gb" not in row and "estimate_bytes" not in row  # a CPU run, --smoke: no estimate
    if rows["dpo-whole"]["host_build_mib"] is not None:  # /proc/self/clear_refs writable: the host's peak, reset
        # the whole UNet's frozen reference: 803,204 fp32 weights, 3.06 MiB, built only for DPO
        assert rows["dpo-whole"]["host_build_mib"] - rows["plain-whole B"]["host_build_mib"] > 2.0
    compared = {entry["adapter"]: entry for entry in result["ratios"]}
    assert list(compared) == ["lora", "whole"]
    for adapter, entry in compared.items():
        for side in ("B", "2B"):
            plain = rows[f"plain-{adapter} {side}"]["step_ms"]
            assert entry[f"step_vs_plain_{side}"] == round(rows[f"dpo-{adapter}"]["step_ms"] / plain, 3)
            assert entry[f"peak_vs_plain_{side}"] is None and entry[f"estimate_vs_plain_{side}"] is None
    assert result["summary"] in stdout
    assert f"dpo-lora (2 pairs): {compared['lora']['step_vs_plain_2B']:.2f}x the step time of plain lora on 4" in stdout


def test_dmd_step_bench_times_dmd_against_the_same_adapters_lcm_step_and_one_fake_update_alone(tmp_path):
    stdout, result = run_bench("dmd_step.py", "--smoke", "--whole_unet", "--device", "cpu",
                               "--json", str(tmp_path / "out.json"))
    assert result == json.loads((tmp_path / "out.json").read_text())
    assert (result["unet"], result["resolution"], result["images"], result["steps"], result["repeats"],
            result["fake_updates"]) == ("tiny", 32, 2, 2, 1, 2)
    rows = {row["name"]: row for row in result["rows"]}
    assert list(rows) == [name.format(adapter) for adapter in ("lora", "whole") for name in
                          ("lcm-{}", "dmd-{}", "dmd-{} fake update", "dmd-{}+gan", "dmd-{}+gan fake update")]
    # B = 2 images, 2 fake updates: each update draws B without gradients and trains the fake score on them (the
    # GAN's critic adds 2B through the down and middle blocks); the generator draws B with gradients, the fake
    # score and the guided teacher (2B) see them without. LCM: the student on B, the teacher on 2B, the target on B.
    assert [(row["images_with_grad"], row["images_through_unet"], row["images_critic"]) for row in rows.values()] == [
        (2, 8, 0), (6, 16, 0), (2, 4, 0), (6, 16, 10), (2, 4, 4)] * 2
    assert [row["part"] for row in rows.values()] == ["step", "step", "fake_update", "step", "fake_update"] * 2
    # both LCM students start as their teacher (a LoRA's up-projection is zero, a whole UNet's copy is equal)
    assert rows["lcm-lora"]["first_loss"] == pytest.approx(rows["lcm-whole"]["first_loss"], rel=1e-5)
    for name, row in rows.items():
        assert ("first_loss" in row) == (row["part"] == "step")
        assert row["trainable_params"] == (11_008 if "lora" in name else 803_204)
        assert len(row["step_s"]) == 1 and row["step_ms"] == round(1000 * row["step_s"][0], 2) > 0
        assert "peak_allocated_gb" not in row and "estimate_bytes" not in row  # a CPU run, --smoke: no estimate
    compared = {entry["name"]: entry for entry in result["ratios"]}
    assert list(compared) == ["dmd-lora", "dmd-lora+gan", "dmd-whole", "dmd-whole+gan"]
    for name, entry in compared.items():
        lcm = rows[f"lcm-{entry['adapter']}"]["step_ms"]
        assert entry["step_vs_lcm"] == round(rows[name]["step_ms"] / lcm, 3)
        assert entry["peak_vs_lcm"] is None and entry["estimate_vs_lcm"] is None
    for entry in result["per_pass"]:  # the generator's part: the step less its fake updates, each as timed alone
        step, fake = rows[entry["name"]]["step_ms"], rows[entry["name"] + " fake update"]["step_ms"]
        assert entry["fake_update_ms"] == fake and entry["generator_ms_derived"] == round(step - 2 * fake, 2)
        assert f"per pass {entry['name']}: one fake-score update {fake:.1f} ms (measured alone" in stdout
    assert stdout.count("(derived: the step less 2 x one update") == 4
    assert result["summary"] in stdout
    assert f"dmd-lora (2 images): {compared['dmd-lora']['step_vs_lcm']:.2f}x the step time of lcm-lora" in stdout


def test_bucket_cycles_hold_exactly_the_square_pixels_and_only_sizes_the_unet_takes():
    from bench import bucket_throughput

    assert bucket_throughput.equal_pixel_buckets(512, 64) == [(256, 1024), (512, 512), (1024, 256)]
    assert bucket_throughput.equal_pixel_buckets(64, 16) == [(32, 128), (64, 64), (128, 32)]
    sizes = bucket_throughput.equal_pixel_buckets(96, 8)
    assert sizes == [(48, 192), (64, 144), (72, 128), (96, 96), (128, 72), (144, 64), (192, 48)]
    assert all(w * h == 96 * 96 for w, h in sizes)
    kept, dropped = bucket_throughput.usable(sizes, "tiny")  # the tiny UNet halves its latents once: 16 px sides
    assert dropped == [(72, 128), (128, 72)] and len(kept) == 5
    kept, dropped = bucket_throughput.usable(sizes, "sd1")  # three halvings: 64 px sides
    assert kept == [] and dropped == sizes


@pytest.mark.slow
def test_bucket_throughput_bench_compares_bucket_cycles_with_square_training(tmp_path):
    stdout, result = run_bench("bucket_throughput.py", "--batch_sizes", "2", "--steps", "1", "--rounds", "1",
                               "--json", str(tmp_path / "out.json"))
    assert result == json.loads((tmp_path / "out.json").read_text())
    assert (result["arch"], result["resolution"], result["bucket_step"]) == ("tiny", 64, 16)
    assert result["cycles"] == {"square": ["64x64"], "buckets": ["32x128", "64x64", "128x32"],
                                "buckets-default": [sd.data.buckets.name(b) for b in sd.data.buckets.default_buckets(64, 16)]}
    rows = {row["variant"]: row for row in result["rows"]}
    assert list(rows) == ["square", "buckets", "buckets-default"]
    assert [s["pixels"] for s in rows["buckets"]["shapes"]] == [64 * 64] * 3  # equal pixel count, exactly
    assert len(rows["buckets-default"]["shapes"]) == 9
    assert all(s["pixels"] <= 64 * 64 for s in rows["buckets-default"]["shapes"])
    for row in rows.values():
        assert row["batch"] == 2 and all(s["first_step_s"] > 0 and s["step_ms"] > 0 for s in row["shapes"])
        cycle_s = sum(s["step_ms"] for s in row["shapes"]) / 1000
        assert row["images_per_s"] == pytest.approx(2 * len(row["shapes"]) / cycle_s)
        assert row["megapixels_per_s"] == pytest.approx(2 * sum(s["pixels"] for s in row["shapes"]) / cycle_s / 1e6)
    assert rows["square"]["pixels_ratio"] == 1.0
    ratios = {r["variant"]: r for r in result["ratios"]}
    assert list(ratios) == ["buckets", "buckets-default"]
    for name, r in ratios.items():
        assert 0 < r["pixels_per_s"] < float("inf") and 0 < r["images_per_s"] < float("inf")
        assert r["pixels_per_s"] == round(rows[name]["megapixels_per_s"] / rows["square"]["megapixels_per_s"], 3)
        assert f"ratio {name}/square at batch 2: pixels/s {r['pixels_per_s']:.3f}x" in stdout
    assert ratios["buckets"]["pixels_per_s"] == ratios["buckets"]["images_per_s"]  # same pixels per image


@pytest.mark.slow
def test_eval_scale_bench_compares_running_statistics_with_keeping_every_feature():
    stdout, result = run_bench("eval_scale.py", "--sizes", "300,1200", "--dim", "32", "--batch", "50")
    assert [(row["impl"], row["n"]) for row in result["rows"]] == [("ours", 300), ("peer", 300), ("ours", 1200),
                                                                   ("peer", 1200)]
    assert all(row["peak_rss_mb"] > 50 for row in result["rows"])
    assert result["max_stat_difference"] < 1e-9
    assert result["distance"]["fid_ours"] > 0 and result["distance"]["abs_difference"] < 1e-6
    assert "ratio peer/ours" in stdout and "peak memory at N=1200 over N=300" in stdout


def test_a_collectives_flat_block_freed_by_another_thread_is_freed_when_the_op_that_made_it_ends():
    """DDP's broadcast at its wrap stages the weights in a block of ``flatten_dense_tensors``; when
    gloo's worker thread drops it last, the record has no free of it."""
    import threading

    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench import memory_estimate

    handed = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        parts = [torch.empty(1 << 18, dtype=torch.uint8) for _ in range(2)]
        handed.append(torch._utils._flatten_dense_tensors(parts))
        del parts
        worker = threading.Thread(target=handed.clear)
        worker.start()
        worker.join()
        after = torch.empty(3 << 19, dtype=torch.uint8)
    assert not handed
    assert memory_estimate.peak_live_bytes(prof, torch.device("cpu")) == 3 << 19  # not 1 MiB more
    del after


@pytest.mark.slow
def test_captioner_speed_bench_times_each_model_batched_and_alone():
    printed, result = run_bench("captioner_speed.py", "--tiny", "--images", "4", "--batch_size", "2", own_process=True)
    assert [row["model"] for row in result["rows"]] == ["blip", "florence2", "wd14"] and result["tiny"]
    for row in result["rows"]:
        assert row["s_per_image"] > 0 and row["batched_speedup"] > 0 and row["peak_rss_gb"] > 0
        assert row["minutes_per_1000"] == pytest.approx(row["s_per_image"] * 1000 / 60, abs=0.1)
    assert "min/1000" in printed


@pytest.mark.slow
def test_caption_stage_scale_bench_runs_the_stage_twice_per_size():
    printed, result = run_bench("caption_stage_scale.py", "--sizes", "12,24", "--shard_size", "8", own_process=True)
    assert [row["images"] for row in result["rows"]] == [12, 24]
    assert all(row["peak_rss_gb"] > 0.1 and row["compose_again_s"] > 0 for row in result["rows"])
    assert "peak at 24 images / at 12" in printed


@pytest.mark.slow
def test_studio_scale_bench_measures_both_readers_at_each_size():
    printed, result = run_bench("studio_scale.py", "--folders", "30,60", "--metrics", "500,20000", "--image_kb", "4")
    assert [(r["what"], r["size"]) for r in result["rows"]] == [("folder scan", 30), ("folder scan", 60),
                                                                ("metrics read", 500), ("metrics read", 20000)]
    assert all(r["peak_mb"] > 0 and r["peer_peak_mb"] > 0 for r in result["rows"])
    assert result["rows"][3]["peer_peak_mb"] > result["rows"][3]["peak_mb"]  # every line kept against a bounded tail
