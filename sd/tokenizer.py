"""The real CLIP tokenizer, built offline.

The CLIP tokenizer's BPE merges ship inside the open-clip-torch wheel. The wheel is only downloaded
and read as a zip (installing it would pull in torchvision). From the merges we derive the
vocab.json + merges.txt that transformers' CLIPTokenizer reads, exactly as OpenAI's tokenizer
orders its 49,408 tokens: 256 byte symbols, the same with "</w>", the merges, then the two specials.
``sd.model.load_tokenizer("tiny")`` loads the folder built here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import sd.files

TOKENIZER_MAX_LENGTH = 77
OPEN_CLIP_WHEEL = "open-clip-torch>=2.20,<4"
CLIP_BPE_MEMBER = "open_clip/bpe_simple_vocab_16e6.txt.gz"
CLIP_NUM_MERGES = 49152 - 256 - 2
# The BPE file is 1.3 MB gzipped, 1.6 MB unpacked: caps far above both, far below a zip or gzip bomb.
MAX_BPE_GZ_BYTES = 16 << 20
MAX_BPE_TEXT_BYTES = 64 << 20


def cache_dir() -> Path:
    """Where derived artefacts (the tiny tokenizer) are kept: ``$SD_CACHE_DIR`` or ``~/.cache/sd1_train``."""
    return Path(os.environ.get("SD_CACHE_DIR", Path.home() / ".cache" / "sd1_train"))


def clip_tokenizer_folder() -> Path:
    """A local CLIP tokenizer folder, built once from the open-clip-torch wheel and cached."""
    folder = cache_dir() / "clip_tokenizer"
    if (folder / "merges.txt").exists():
        return folder
    bpe_text = _read_clip_bpe()
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".clip_tokenizer."))
    _write_clip_tokenizer_files(bpe_text, staging)
    try:
        os.replace(staging, folder)
    except OSError:  # another process finished first; its folder is identical
        _remove_tree(staging)
    return folder


def _read_clip_bpe() -> str:
    override = os.environ.get("SD_CLIP_BPE")
    if override:
        data = sd.files.read_file_bounded(override, MAX_BPE_GZ_BYTES)
        return sd.files.gunzip_bounded(data, MAX_BPE_TEXT_BYTES, override).decode("utf-8")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", tmp,
               OPEN_CLIP_WHEEL]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("open_clip_torch-*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(
                "could not download the open-clip-torch wheel that holds the CLIP BPE merges "
                f"({result.stderr.strip()[-500:]}); set SD_CLIP_BPE to a local bpe_simple_vocab_16e6.txt.gz"
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            data = sd.files.read_zip_member(wheel, wheel.getinfo(CLIP_BPE_MEMBER), MAX_BPE_GZ_BYTES)
        return sd.files.gunzip_bounded(data, MAX_BPE_TEXT_BYTES, f"{wheels[0].name}:{CLIP_BPE_MEMBER}").decode("utf-8")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character table used by CLIP's BPE."""
    # Printable bytes map to themselves and come first; the rest follow, mapped above U+00FF. The
    # order matters: it fixes the ids of the first 512 vocabulary entries.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {byte: chr(byte) for byte in printable}
    others = [byte for byte in range(256) if byte not in table]
    table.update({byte: chr(256 + i) for i, byte in enumerate(others)})
    return table


def _write_clip_tokenizer_files(bpe_text: str, folder: Path) -> None:
    merges = [tuple(line.split()) for line in bpe_text.split("\n")[1 : CLIP_NUM_MERGES + 1]]
    symbols = list(_bytes_to_unicode().values())
    tokens = symbols + [s + "</w>" for s in symbols] + ["".join(m) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {token: i for i, token in enumerate(tokens)}
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    merges_text = "#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n"
    (folder / "merges.txt").write_text(merges_text, encoding="utf-8")
    config = {
        "tokenizer_class": "CLIPTokenizer",
        "model_max_length": TOKENIZER_MAX_LENGTH,
        "bos_token": "<|startoftext|>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "do_lower_case": True,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


def _remove_tree(path: Path) -> None:
    for child in sorted(path.rglob("*"), reverse=True):
        child.rmdir() if child.is_dir() else child.unlink()
    path.rmdir()
