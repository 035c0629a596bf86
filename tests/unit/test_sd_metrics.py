"""sd.train.metrics: metrics.jsonl across crashes and resumes, and the loss plot."""

import json
from types import SimpleNamespace

import pytest

import sd.train.metrics
from sd.train.metrics import MetricsError, MetricsLog

NO_WANDB = SimpleNamespace(wandb_mode="disabled", tensorboard="false")


def record_lines(steps) -> list[str]:
    return [json.dumps({"step": s, "loss": 1.0 / s, "lr": 1e-4, "grad_norm": 0.5}) for s in steps]


def write_metrics(run_dir, lines: list[str], tail: str = "") -> bytes:
    run_dir.mkdir(parents=True, exist_ok=True)
    data = "".join(line + "\n" for line in lines) + tail
    (run_dir / "metrics.jsonl").write_text(data)
    return data.encode()


def steps_in(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


@pytest.mark.parametrize("torn", ['{"step": 4, "loss": 0.2', '{', '\x00' * 37, '{"step": 4, "loss": 0.2, "lr"\n'])
def test_a_torn_last_line_is_dropped_on_resume_and_logged(tmp_path, caplog, torn):
    lines = record_lines([1, 2, 3])
    write_metrics(tmp_path, lines, torn)
    log = MetricsLog(tmp_path, NO_WANDB, resume_step=3)
    path = tmp_path / "metrics.jsonl"
    assert path.read_text() == "".join(line + "\n" for line in lines)  # the good records, byte for byte
    assert f"{path}: dropped its torn last line" in caplog.text
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary left behind
    log.write({"step": 4, "loss": 0.25})
    assert steps_in(path) == [1, 2, 3, 4]


def test_records_past_the_resumed_step_go_with_the_torn_line(tmp_path):
    write_metrics(tmp_path, record_lines([1, 2, 3, 4, 5]), '{"step": 6, "lo')
    MetricsLog(tmp_path, NO_WANDB, resume_step=3)
    assert steps_in(tmp_path / "metrics.jsonl") == [1, 2, 3]


def test_an_intact_file_is_left_alone(tmp_path, caplog):
    before = write_metrics(tmp_path, record_lines([1, 2, 3]))
    MetricsLog(tmp_path, NO_WANDB, resume_step=3)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before and "torn" not in caplog.text


@pytest.mark.parametrize("bad, number, message", [
    ('{"step": 2, "lo', 2, "is not JSON"),
    ("\x00\x00\x00", 2, "is not JSON"),
    ("[2, 0.5]", 2, "is not a metrics record"),
    ('{"loss": 0.5}', 2, "is not a metrics record"),
    ('{"step": "2"}', 2, "is not a metrics record"),
])
def test_a_corrupt_line_before_the_last_is_an_error_naming_file_and_line(tmp_path, bad, number, message):
    lines = record_lines([1, 2, 3])
    lines[1] = bad
    before = write_metrics(tmp_path, lines)
    path = tmp_path / "metrics.jsonl"
    with pytest.raises(MetricsError) as error:
        MetricsLog(tmp_path, NO_WANDB, resume_step=3)
    assert str(error.value).startswith(f"{path}: line {number} {message}")
    assert "\n" not in str(error.value)
    assert path.read_bytes() == before  # nothing rewritten


def test_the_line_number_is_the_one_an_editor_shows_blank_lines_included(tmp_path):
    lines = record_lines([1, 2])
    write_metrics(tmp_path, [lines[0], "", "  ", "not json", lines[1], ""])
    with pytest.raises(MetricsError, match=r"metrics.jsonl: line 4 is not JSON"):
        MetricsLog(tmp_path, NO_WANDB, resume_step=5)


def test_plot_leaves_out_a_torn_last_line_and_refuses_a_corrupt_one(tmp_path):
    write_metrics(tmp_path, record_lines([1, 2, 3]), '{"step": 4, "lo')
    sd.train.metrics.plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "loss.png")
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    write_metrics(tmp_path, [record_lines([1])[0], "garbage", record_lines([3])[0]])
    with pytest.raises(MetricsError, match=rf"^{tmp_path / 'metrics.jsonl'}: line 2 is not JSON"):
        sd.train.metrics.plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "loss2.png")
    assert not (tmp_path / "loss2.png").exists()
