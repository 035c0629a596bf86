"""New tokens in a frozen CLIP text encoder: the rows they add to its token embedding, and the prompts
that use them.

A token learned by textual inversion (Gal et al. 2022, "An Image is Worth One Word") is one or more
new rows of the token-embedding matrix. They are kept apart from it, in ``NewTokenEmbedding.vectors``:
the optimizer sees only that parameter, so every other row stays bit for bit what it was (weight
decay included, which would otherwise move rows whose gradient is zero).

A token of several vectors is, as in diffusers, the tokens ``<tok>``, ``<tok>_1``, ... ``<tok>_{N-1}``
in the tokenizer; ``sd.model.tokenize`` writes ``<tok>`` in a prompt as all of them (``expand``).
"""

from __future__ import annotations

import contextlib
import re

import torch
import torch.nn.functional as F


class EmbeddingError(ValueError):
    """A token or embedding that cannot be added: its message names the token or the file."""


def token_names(token: str, vectors: int) -> list[str]:
    """The tokenizer's names of a token of ``vectors`` vectors: ``<tok>``, ``<tok>_1``, ..."""
    return [token] + [f"{token}_{i}" for i in range(1, vectors)]


class NewTokenEmbedding(torch.nn.Module):
    """A token embedding with rows appended: ids below ``first`` read ``base``, the rest ``vectors``.

    ``base`` stays untouched (an ``nn.Embedding``, or another ``NewTokenEmbedding`` when several files
    add tokens); ``vectors`` ``(N, D)`` float32 holds the new rows, ids ``first`` to ``first + N - 1``.
    """

    def __init__(self, base: torch.nn.Module, vectors: torch.Tensor, tokens: list[str]):
        super().__init__()
        self.base = base
        self.first = int(base.num_embeddings)
        self.vectors = torch.nn.Parameter(vectors.detach().float().clone(), requires_grad=False)
        self.tokens = list(tokens)  # one name per vector, in order

    @property
    def num_embeddings(self) -> int:
        return self.first + self.vectors.shape[0]

    @property
    def weight(self) -> torch.Tensor:
        """The whole matrix, base rows then new ones (read by code that inspects input embeddings)."""
        base = self.base.weight
        return torch.cat([base, self.vectors.to(base.dtype)])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # No branch on whether a batch holds a new id: that would be a read of the device every call.
        new = input_ids >= self.first
        out = self.base(input_ids.clamp(max=self.first - 1))
        extra = F.embedding((input_ids - self.first).clamp(0, self.vectors.shape[0] - 1), self.vectors)
        return torch.where(new[..., None], extra.to(out.dtype), out)


class LearnedToken:
    """The token a textual-inversion run trains, as checkpoint state: ``{"emb_params": (N, D)}``, the
    layout AUTOMATIC1111 and ComfyUI load (``sd.embedding.formats``)."""

    def __init__(self, text_encoder):
        self.layer = added_embeddings(text_encoder)[0]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"emb_params": self.layer.vectors}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        vectors = state.get("emb_params")
        if vectors is None or vectors.shape != self.layer.vectors.shape:
            found = None if vectors is None else tuple(vectors.shape)
            raise KeyError(f"the learned token's vectors: expected emb_params of shape "
                           f"{tuple(self.layer.vectors.shape)}, found {found}")
        if not bool(torch.isfinite(vectors).all()):
            raise ValueError("the learned token's vectors hold non-finite values (NaN or inf)")
        with torch.no_grad():
            self.layer.vectors.copy_(vectors)


def added_embeddings(text_encoder) -> list[NewTokenEmbedding]:
    """The ``NewTokenEmbedding`` layers of ``text_encoder``, outermost first."""
    found, module = [], text_encoder.get_input_embeddings()
    while isinstance(module, NewTokenEmbedding):
        found.append(module)
        module = module.base
    return found


@contextlib.contextmanager
def without_added(text_encoder):
    """``text_encoder`` with its original token embedding while inside (a whole-model export keeps the
    vocabulary other tools expect; the learned tokens are files of their own)."""
    layers = added_embeddings(text_encoder)
    if not layers:
        yield text_encoder
        return
    text_encoder.set_input_embeddings(layers[-1].base)
    try:
        yield text_encoder
    finally:
        text_encoder.set_input_embeddings(layers[0])


def initial_vectors(tokenizer, text_encoder, init: str, vectors: int) -> torch.Tensor:
    """``(vectors, D)`` start values: the embeddings of the tokens of ``init`` (a word or a few),
    repeated in turn when the token has more vectors than ``init`` has tokens."""
    ids = tokenizer(init, add_special_tokens=False).input_ids
    if not ids:
        raise EmbeddingError(f"embedding_init: {init!r} has no tokens; give a word close to the concept, e.g. 'dog'")
    table = text_encoder.get_input_embeddings()
    with torch.no_grad():
        rows = table(torch.tensor(ids, device=table.weight.device)).float().cpu()
    return rows[torch.arange(vectors) % len(ids)]


def add_token(tokenizer, text_encoder, token: str, vectors: torch.Tensor, trainable: bool = False) -> NewTokenEmbedding:
    """Teach ``tokenizer`` and ``text_encoder`` the token ``token`` with embedding ``vectors`` ``(N, D)``.

    The token (and for N > 1 its ``_1`` ... names) must be new to the tokenizer, and the new ids must
    follow the encoder's rows (a tokenizer and encoder of one model). ``trainable``: the new rows
    require a gradient (textual-inversion training); nothing else of the encoder changes.
    """
    check_token(token)
    names = token_names(token, vectors.shape[0])
    vocabulary = tokenizer.get_vocab()
    known = [n for n in names if n in vocabulary]
    if known:
        raise EmbeddingError(f"token {known[0]!r} is already in the tokenizer's vocabulary; a learned token must be "
                             "a new word, e.g. <my-concept>")
    table = text_encoder.get_input_embeddings()
    width = table.weight.shape[1]
    if vectors.ndim != 2 or vectors.shape[1] != width:
        raise EmbeddingError(f"token {token!r}: vectors of shape {tuple(vectors.shape)} do not fit a text encoder "
                             f"whose embeddings have {width} values (an embedding of another model)")
    if len(tokenizer) != table.num_embeddings:
        raise EmbeddingError(f"the tokenizer has {len(tokenizer)} tokens but the text encoder {table.num_embeddings} "
                             "embedding rows: they are not one model's")
    tokenizer.add_tokens(names)
    ids = tokenizer.convert_tokens_to_ids(names)
    if ids != list(range(table.num_embeddings, table.num_embeddings + len(names))):
        raise EmbeddingError(f"token {token!r} got ids {ids}, not the rows after the encoder's {table.num_embeddings}")
    layer = attach_rows(text_encoder, vectors, names, trainable)
    expansions = dict(getattr(tokenizer, "token_expansions", {}))
    if len(names) > 1:
        expansions[token] = " ".join(names)
    tokenizer.token_expansions = expansions
    return layer


def attach_rows(text_encoder, vectors: torch.Tensor, names: list[str], trainable: bool = False) -> NewTokenEmbedding:
    """Append ``vectors`` to ``text_encoder``'s token embedding as the rows of ``names``."""
    table = text_encoder.get_input_embeddings()
    layer = NewTokenEmbedding(table, vectors.to(table.weight.device), names)
    layer.vectors.requires_grad_(trainable)
    text_encoder.set_input_embeddings(layer)
    return layer


def freeze_for_inversion(unet, text_encoder, precision: str) -> None:
    """Textual inversion trains the new rows alone: the UNet and text encoder frozen, the UNet stored in
    the type autocast computes it in (half its memory at bf16 or fp16)."""
    unet.requires_grad_(False)
    text_encoder.requires_grad_(False)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if dtype is not None:
        for param in unet.parameters():
            if param.is_floating_point():
                param.data = param.data.to(dtype)


def check_token(token: str) -> None:
    if not token or token != token.strip() or any(c.isspace() for c in token):
        raise EmbeddingError(f"token {token!r}: one word without spaces, e.g. <my-concept>")
    if token.lower() != token:
        raise EmbeddingError(f"token {token!r}: CLIP's tokenizer lower-cases prompts, so a token must be lower case "
                             f"({token.lower()!r})")


def expand(tokenizer, prompts: list[str]) -> list[str]:
    """``prompts`` with each multi-vector token written as all its names (``<tok>`` -> ``<tok> <tok>_1 ...``).
    A token already written out is left as it is, so expanding twice gives what expanding once does."""
    expansions = getattr(tokenizer, "token_expansions", None)
    if not expansions:
        return list(prompts)
    pattern = re.compile("|".join(re.escape(t) + r"(?!_\d)" + f"(?!{re.escape(expansions[t][len(t):])})"
                                  for t in sorted(expansions, key=len, reverse=True)))
    return [pattern.sub(lambda m: expansions[m.group(0)], p) for p in prompts]
