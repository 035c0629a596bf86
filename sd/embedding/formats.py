"""Files of learned tokens that other tools load.

Two layouts, each one tensor ``(N, D)`` in a ``.safetensors`` file:

* ``a1111``: the key ``emb_params``, the name the file's stem. AUTOMATIC1111 (``embeddings/``) takes a
  file holding a single tensor and names the token after the file; ComfyUI's embedding loader
  (``embedding:NAME`` in a prompt) takes its ``clip_l`` key or else its first tensor; diffusers'
  ``load_textual_inversion`` takes it with ``token=``.
* ``diffusers``: the key is the token itself (``learned_embeds.safetensors`` of diffusers' example);
  ``load_textual_inversion`` then needs no ``token=``, and the single-tensor rule above holds too.

Reading accepts both, and AUTOMATIC1111's ``.pt`` files (``string_to_param``), loaded without
unpickling arbitrary objects (``weights_only=True``).
"""

from __future__ import annotations

from pathlib import Path

import torch

import sd.files
from sd.embedding.tokens import EmbeddingError, check_token

EMBEDDING_FORMATS = ("a1111", "diffusers")
DEFAULT_EMBEDDING_FORMAT = "a1111"
A1111_KEY = "emb_params"
DIFFUSERS_FILE = "learned_embeds.safetensors"


def embedding_output(out: str | Path, token: str, embedding_format: str = DEFAULT_EMBEDDING_FORMAT) -> Path:
    """Where ``write_embedding`` writes: ``out`` itself when it names a ``.safetensors`` file, else a file
    in the folder ``out``: ``<token without brackets>.safetensors`` (a1111: the stem is the name the
    tools prompt it by) or ``learned_embeds.safetensors`` (diffusers)."""
    out = Path(out)
    if out.suffix == ".safetensors":
        return out
    if embedding_format == "diffusers":
        return out / DIFFUSERS_FILE
    return out / f"{file_stem(token)}.safetensors"


def file_stem(token: str) -> str:
    """A file name for ``token``: its characters that are safe in a file name (``<cyan-sks>`` -> ``cyan-sks``)."""
    stem = "".join(c for c in token if c.isalnum() or c in "-_.").strip(".")
    return stem or "embedding"


def write_embedding(out: str | Path, token: str, vectors: torch.Tensor,
                    embedding_format: str = DEFAULT_EMBEDDING_FORMAT, metadata: dict | None = None) -> Path:
    """Write the ``(N, D)`` ``vectors`` of ``token`` in ``embedding_format``, atomically; returns the file."""
    from safetensors.torch import save_file

    if embedding_format not in EMBEDDING_FORMATS:
        raise ValueError(f"embedding format {embedding_format!r}: one of {', '.join(EMBEDDING_FORMATS)}")
    path = embedding_output(out, token, embedding_format)
    key = A1111_KEY if embedding_format == "a1111" else token
    tensors = {key: vectors.detach().float().cpu().contiguous()}
    header = {"name": token, "vectors": str(vectors.shape[0]), **{k: str(v) for k, v in (metadata or {}).items()}}
    sd.files.write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=header))
    return path


def read_embedding(path: str | Path, token: str | None = None) -> tuple[str, torch.Tensor]:
    """``(token, vectors (N, D) float32)`` of an embedding file of either layout (or an A1111 ``.pt``).

    The token: ``token`` when given, else the key of a diffusers file, else the name the file records
    (``write_embedding``'s header), else the file's stem in lower case (how AUTOMATIC1111 and ComfyUI
    name an embedding). Errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise EmbeddingError(f"embedding {path}: no such file")
    tensors, recorded = _read_tensors(path)
    if len(tensors) != 1:
        raise EmbeddingError(f"embedding {path}: holds {len(tensors)} tensors ({sorted(tensors)[:4]}), an embedding "
                             "file holds one")
    (key, vectors), = tensors.items()
    if vectors.ndim == 1:
        vectors = vectors[None]
    if vectors.ndim != 2 or not vectors.is_floating_point() or vectors.shape[0] < 1:
        raise EmbeddingError(f"embedding {path}: {key} has shape {tuple(vectors.shape)}, not (vectors, width)")
    if not bool(torch.isfinite(vectors).all()):
        raise EmbeddingError(f"embedding {path}: holds non-finite values (NaN or inf); the file is damaged")
    if token is None:
        token = key if key not in (A1111_KEY, "*") else recorded or path.stem.lower()
    try:
        check_token(token)
    except EmbeddingError as error:
        raise EmbeddingError(f"embedding {path}: {error}; name it with FILE:TOKEN") from None
    return token, vectors.float()


def _read_tensors(path: Path) -> tuple[dict[str, torch.Tensor], str | None]:
    """The file's tensors, and the token name it records (None where it records none)."""
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), "pt") as handle:
                return {k: handle.get_tensor(k) for k in handle.keys()}, (handle.metadata() or {}).get("name")
        except (SafetensorError, OSError) as error:
            raise EmbeddingError(f"embedding {path}: not a readable safetensors file ({error})") from error
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # pickle refusals and damaged files come as many types
        raise EmbeddingError(f"embedding {path}: cannot be read without running its code ({str(error)[:120]}); "
                             "use a .safetensors embedding") from error
    if isinstance(data, dict) and isinstance(data.get("string_to_param"), dict):
        data = data["string_to_param"]
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise EmbeddingError(f"embedding {path}: neither an A1111 embedding (string_to_param) nor a token -> tensor dict")
    return dict(data), None
