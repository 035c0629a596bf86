"""sd.studio.app: the pages start where the README's quick starts do, and no page carries the API's description."""

import asyncio
import shlex
from pathlib import Path

import yaml

from readme_commands import readme_block
from sd.studio.app import WithoutApiDescription, build
from sd.studio.runs import Roots

ROOT = Path(__file__).resolve().parents[2]


def flag(line: str, name: str) -> str:
    words = shlex.split(line)
    return words[words.index(name) + 1]


def test_the_pages_start_where_the_readmes_quick_starts_do(tmp_path):
    """Offline, as the README: 64 px, the VAE trained into runs/my_vae, the tiny tokenizer, the run runs/mine that
    every other recipe starts from, its sample prompt at the sampler's own steps and CFG, quick start 3's export."""
    pages = build(Roots([tmp_path]), ROOT)
    value = {block.elem_id: getattr(block, "value", None) for block in pages.blocks.values()
             if getattr(block, "elem_id", None)}
    quick_start = {shlex.split(line)[1]: line for line in readme_block("**2. Your images: a model from scratch.**")}
    import_line, vae_line = quick_start["pipeline/01e_import_folder.py"], quick_start["train_vae.py"]
    assert value["data-folder"] == flag(import_line, "--input")
    assert value["data-resolution"] == int(flag(import_line, "--resolution")) == int(flag(vae_line, "--resolution"))
    assert value["data-vae"] == flag(vae_line, "--out") == flag(quick_start["encode_latents.py"], "--vae")
    assert value["data-train-vae"] is True and flag(vae_line, "--preset") == "tiny"
    assert value["data-tokenizer"] == flag(quick_start["pipeline/04_preprocess_to_cache.py"], "--tokenizer")
    assert f"data/{value['data-name']}/shards" == flag(import_line, "--out")
    recipe = flag(quick_start["SD_Train.py"], "--config")
    assert value["train-preset"] == recipe
    out_dir = yaml.safe_load((ROOT / recipe).read_text())["out_dir"]
    sample_ckpt = flag(quick_start["SD_ImageGen.py"], "--ckpt")
    assert f"runs/{value['train-run']}" == out_dir == sample_ckpt == value["sample-run"]
    for other in sorted((ROOT / "configs" / "quickstart").glob("*.yaml")):  # every other recipe starts from it
        assert yaml.safe_load(other.read_text()).get("init_from", out_dir) == out_dir, other
    assert value["sample-prompt"] == flag(quick_start["SD_ImageGen.py"], "--prompt")
    assert value["sample-steps"] == 0 and value["sample-cfg"] == 0  # not given: SD_ImageGen.py's defaults
    lora_lines = readme_block("**3. Your subject: a LoRA.**")
    assert value["export-run"] == flag(lora_lines[-1], "--ckpt") and "--export_lora" in lora_lines[-1]


def served(body: bytes, content_type: bytes) -> bytes:
    """What a client receives from ``WithoutApiDescription`` over an app that answers ``body`` in two parts."""
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body[:50], "more_body": True})
        await send({"type": "http.response.body", "body": body[50:]})

    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request"}

    asyncio.run(WithoutApiDescription(app)({"type": "http", "method": "GET", "path": "/"}, receive, send))
    length = dict(sent[0]["headers"])[b"content-length"]
    received = b"".join(message.get("body", b"") for message in sent[1:])
    assert int(length) == len(received)
    return received


def test_no_page_carries_the_api_description():
    page = (b'<html><head><script>window.gradio_config = {"auth_required": true};</script>'
            b'<script>window.gradio_api_info = {"named_endpoints": {"/save_caption": '
            b'{"parameters": [{"default": "/repo/configs"}]}}};</script>'
            b'</head></html>')
    assert served(page, b"text/html; charset=utf-8") == page.replace(
        page[page.index(b"<script>window.gradio_api_info"):page.index(b"</head>")],
        b"<script>window.gradio_api_info = null;</script>")
    info = b'{"named_endpoints": {"/save_caption": {}}, "window.gradio_api_info = x;": 1}'
    assert served(info, b"application/json") == info  # what /gradio_api/info answers after the login: as it is


def test_the_sample_page_offers_the_samplers_sd_imagegen_takes(tmp_path):
    import sd.sampling

    pages = build(Roots([tmp_path]), ROOT)
    sampler = next(block for block in pages.blocks.values() if getattr(block, "elem_id", None) == "sample-sampler")
    assert [value for _, value in sampler.choices] == ["auto", *sd.sampling.SAMPLERS]
