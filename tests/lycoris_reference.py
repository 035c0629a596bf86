"""Readers of a kohya-layout LoHa or LoKr layer written from the math of two other tools, not from our package:
what LyCORIS' own loader builds and applies (``lycoris/modules/lokr.py`` / ``loha.py``: the module made by
``make_module_from_state_dict``, then its ``get_weight``; ``lycoris/functional/general.py`` ``factorization``)
and what ComfyUI merges (``comfy/weight_adapter/lokr.py`` / ``loha.py``: ``calculate_weight``). Tests compare
our files against them. No Tucker cores (we write none) and no ``decompose_both`` (we never set it)."""

import math

import torch


def factorization(side: int, factor: int = -1) -> tuple[int, int]:
    """LyCORIS' split of a side into ``(m, n)``, ``m <= n``, step by step as its loop takes it: ``factor`` and the
    rest when it divides; else the divisors from 1 up while the first stays below the second and at most
    ``factor`` (its other stop, a growing sum, never triggers: the sum it compares with is ``1 + side``)."""
    if factor > 0 and side % factor == 0:
        m, n = factor, side // factor
        return (n, m) if m > n else (m, n)
    limit = side if factor < 0 else factor
    m, n = 1, side
    while m < n:
        candidate = m + 1
        while side % candidate:
            candidate += 1
        if candidate > limit:
            break
        m, n = candidate, side // candidate
    return (n, m) if m > n else (m, n)


def lokr_shapes(weight_shape, rank: int, factor: int = -1, full_matrix: bool = False) -> dict[str, tuple]:
    """The tensors LyCORIS' LokrModule makes for a layer of ``weight_shape`` (a Linear's or a convolution's): ``w1``
    whole, ``w2`` whole when the rank reaches half its larger side (or ``full_matrix``), else ``w2_a @ w2_b`` with
    a convolution's kernel in ``w2_b``'s columns."""
    out_side, in_side, *kernel = weight_shape
    (a, b), (c, d) = factorization(out_side, factor), factorization(in_side, factor)
    if full_matrix or rank >= max(b, d) / 2:
        return {"lokr_w1": (a, c), "lokr_w2": (b, d, *kernel)}
    return {"lokr_w1": (a, c), "lokr_w2_a": (b, rank), "lokr_w2_b": (rank, d * math.prod(kernel))}


def lycoris_lokr_factor(t: dict[str, torch.Tensor]) -> int:
    """The factor LyCORIS' loader infers from a LoKr layer's tensors (``make_module_from_state_dict``; its sides
    counted from the tensors, a convolution's kernel within ``w2_b``'s columns as it counts them: for some
    convolutions with a low-rank ``w2`` it infers another factor than the one the layer was made with, and then
    refuses a file LyCORIS itself wrote, e.g. 16 -> 64 channels at rank 2 and factor -1)."""
    w1 = tuple(t["lokr_w1"].shape)
    w2 = tuple(t["lokr_w2"].shape[:2]) if "lokr_w2" in t else (t["lokr_w2_a"].shape[0], t["lokr_w2_b"].shape[1])
    out_side, in_side = w1[0] * w2[0], w1[1] * w2[1]
    if w1[0] == factorization(out_side)[0] and w1[1] == factorization(in_side)[0]:
        return -1
    first = max(w1)
    second = max(t["lokr_w2"].shape) if "lokr_w2" in t else max(w2)
    for candidate in (first, second):
        if out_side % candidate == 0 and in_side % candidate == 0 and candidate in (w1[0], w2[0]) \
                and candidate in (w1[1], w2[1]):
            return candidate
    return min(first, second)


def lycoris_lokr_delta(t: dict[str, torch.Tensor], alpha: float | None, weight_shape,
                       factor: int | None = None) -> torch.Tensor:
    """What LyCORIS' LokrModule loaded from ``t`` adds to a weight of ``weight_shape``; a ValueError where its
    loader refuses the tensors (its module's tensors have other shapes than the file's). ``factor``: the factor
    the module is made with, None: the one its loader infers from the tensors (``lycoris_lokr_factor``)."""
    if "lokr_t2" in t or "lokr_w1_a" in t:
        raise NotImplementedError("Tucker cores and a low-rank w1 are not written by us")
    full_matrix = "lokr_w2" in t
    rank = 1 if full_matrix else t["lokr_w2_a"].shape[1]
    expected = lokr_shapes(weight_shape, rank, lycoris_lokr_factor(t) if factor is None else factor, full_matrix)
    found = {k: tuple(v.shape) for k, v in t.items()}
    if found != expected:
        raise ValueError(f"LyCORIS' loader makes {expected} for a weight {tuple(weight_shape)}, the file holds {found}")
    alpha = rank if not alpha else alpha
    if full_matrix:  # use_w1 and use_w2: "use scale = 1"
        alpha = rank
    w1 = t["lokr_w1"].double()
    w2 = t["lokr_w2"].double() if full_matrix else t["lokr_w2_a"].double() @ t["lokr_w2_b"].double()
    for _ in range(w2.dim() - w1.dim()):
        w1 = w1.unsqueeze(-1)
    return (torch.kron(w1, w2.contiguous()) * (alpha / rank)).reshape(weight_shape)


def comfyui_lokr_delta(t: dict[str, torch.Tensor], alpha: float | None, weight_shape) -> torch.Tensor:
    """What ComfyUI adds for a LoKr layer at strength 1: ``kron(w1, w2)`` times alpha / dim, dim the rank of the
    last low-rank factor, and times 1 when both factors are whole or the file has no alpha."""
    dim = None
    w1 = t.get("lokr_w1")
    if w1 is None:
        dim = t["lokr_w1_b"].shape[0]
        w1 = t["lokr_w1_a"] @ t["lokr_w1_b"]
    w2 = t.get("lokr_w2")
    if w2 is None:
        dim = t["lokr_w2_b"].shape[0]
        w2 = t["lokr_w2_a"].double() @ t["lokr_w2_b"].double()
    w1, w2 = w1.double(), w2.double()
    if w2.dim() == 4:
        w1 = w1[:, :, None, None]
    scale = alpha / dim if alpha is not None and dim is not None else 1.0
    return scale * torch.kron(w1, w2).reshape(weight_shape)


def lycoris_loha_delta(t: dict[str, torch.Tensor], alpha: float | None, weight_shape) -> torch.Tensor:
    """What LyCORIS' LohaModule loaded from ``t`` adds: ``(w1_a w1_b) * (w2_a w2_b)`` times alpha / r (r the rows
    of ``w1_b``; no alpha or 0: r), a convolution's kernel within the ``_b`` factors' columns."""
    rank = t["hada_w1_b"].shape[0]
    expected = {"hada_w1_a": (weight_shape[0], rank), "hada_w1_b": (rank, math.prod(weight_shape[1:])),
                "hada_w2_a": (weight_shape[0], rank), "hada_w2_b": (rank, math.prod(weight_shape[1:]))}
    found = {k: tuple(v.shape) for k, v in t.items()}
    if found != expected:
        raise ValueError(f"LyCORIS' loader makes {expected} for a weight {tuple(weight_shape)}, the file holds {found}")
    alpha = rank if not alpha else alpha
    d = {k: v.double() for k, v in t.items()}
    product = (d["hada_w1_a"] @ d["hada_w1_b"]) * (d["hada_w2_a"] @ d["hada_w2_b"])
    return (product * (alpha / rank)).reshape(weight_shape)


def comfyui_loha_delta(t: dict[str, torch.Tensor], alpha: float | None, weight_shape) -> torch.Tensor:
    """What ComfyUI adds for a LoHa layer at strength 1: the same product times alpha / r (times 1 with no alpha)."""
    d = {k: v.double() for k, v in t.items()}
    scale = alpha / d["hada_w1_b"].shape[0] if alpha is not None else 1.0
    return scale * ((d["hada_w1_a"] @ d["hada_w1_b"]) * (d["hada_w2_a"] @ d["hada_w2_b"])).reshape(weight_shape)


READERS = {"lokr": {"LyCORIS": lycoris_lokr_delta, "ComfyUI": comfyui_lokr_delta},
           "loha": {"LyCORIS": lycoris_loha_delta, "ComfyUI": comfyui_loha_delta}}


def layers_of_file(tensors: dict[str, torch.Tensor],
                   prefix: str = "lora_unet_") -> dict[str, tuple[dict, float | None]]:
    """A kohya-layout file's tensors by layer key (without ``prefix``): ``{key: ({tensor name: tensor}, alpha)}``,
    DoRA's ``dora_scale`` left out."""
    out: dict[str, tuple[dict, float | None]] = {}
    for name, tensor in tensors.items():
        if not name.startswith(prefix):
            continue
        key, _, suffix = name[len(prefix):].partition(".")
        own, alpha = out.get(key, ({}, None))
        if suffix == "alpha":
            alpha = float(tensor)
        elif suffix != "dora_scale":
            own[suffix] = tensor
        out[key] = (own, alpha)
    return out
