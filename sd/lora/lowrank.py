"""Low-rank factors of a weight difference: the math of extracting a LoRA from two models and of resizing one.

A layer's difference ``delta`` (out, in) or (out, in, kh, kw) becomes ``up @ down`` by a truncated SVD of its
(out, in * kh * kw) matrix: ``up = U[:, :r] * S[:r]``, ``down = Vh[:r]`` (Eckart-Young: the best rank-r
approximation in the Frobenius norm). The rank is fixed or chosen per layer from the singular values, by the
rules kohya's ``resize_lora.py`` names:

* ``sv_ratio``: the singular values above the largest divided by the ratio;
* ``sv_fro``: the fewest whose squares hold the given share of the squared Frobenius norm (a share of 0.9
  keeps 90% of the norm itself: 81% of its square);
* ``sv_cumulative``: the fewest whose sum holds the given share of the singular values' sum;

each capped at ``max_rank``. ``clamp_quantile`` below 1 clamps the factors' entries to plus or minus that quantile
of their signed values, as kohya's extraction does against a few outliers (0.99 of symmetric values: about the
0.98 quantile of their magnitudes; the result is then no longer the SVD's, and its error grows: measured on
random rank-8 changes, 0.16-0.25 of the difference's norm against 0.001 unclamped, bench/extract_lora.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

RANK_METHODS = ("fixed", "sv_ratio", "sv_fro", "sv_cumulative")


@dataclass(frozen=True)
class RankRule:
    """How many singular values a layer keeps: ``max_rank`` for ``fixed``, else those ``method`` chooses with
    ``param`` (its ratio or share), at most ``max_rank``."""

    max_rank: int
    method: str = "fixed"
    param: float = 0.0

    def check(self, what: str = "rank") -> "RankRule":
        if isinstance(self.max_rank, bool) or not isinstance(self.max_rank, int) or self.max_rank < 1:
            raise ValueError(f"{what}: a whole number >= 1, got {self.max_rank!r}")
        if self.method not in RANK_METHODS:
            raise ValueError(f"{what}: the dynamic method is one of {', '.join(RANK_METHODS[1:])}, got {self.method!r}")
        if self.method == "sv_ratio" and not self.param > 1:
            raise ValueError(f"{what}: sv_ratio keeps the singular values above the largest / ratio: a ratio > 1, "
                             f"got {self.param}")
        if self.method in ("sv_fro", "sv_cumulative") and not 0 < self.param <= 1:
            raise ValueError(f"{what}: {self.method} keeps a share in (0, 1], got {self.param}")
        return self

    def rank(self, singular_values: torch.Tensor) -> int:
        """The rank kept of ``singular_values`` (descending), at least 1."""
        s = singular_values.double()
        if self.method == "fixed" or not bool(s[0] > 0):
            found = self.max_rank
        elif self.method == "sv_ratio":
            found = int((s > s[0] / self.param).sum())
        else:
            values = s.square() if self.method == "sv_fro" else s
            share = torch.cumsum(values, 0) / values.sum()
            target = self.param ** 2 if self.method == "sv_fro" else self.param
            found = int((share < target - 1e-12).sum()) + 1  # the first index whose share reaches the target
        return max(1, min(found, self.max_rank, len(s)))


def factor(delta: torch.Tensor, rule: RankRule, clamp_quantile: float = 1.0
           ) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``(up, down, report)`` with ``up @ down`` the truncated SVD of ``delta`` (fp32), shaped as a LoRA's
    factors for the layer: (out, r) and (r, in), or (out, r, 1, 1) and (r, in, kh, kw) for a convolution.
    ``report``: ``rank``, ``full_rank``, ``fro_kept`` (the share of the Frobenius norm kept, in [0, 1])."""
    matrix = delta.float().flatten(1)
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    return _truncated(u, s, vh, delta.shape, rule, clamp_quantile)


def refactor(up: torch.Tensor, down: torch.Tensor, rule: RankRule, clamp_quantile: float = 1.0
             ) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``factor(up @ down)`` without forming the product's SVD at its full size: QR of both factors, the SVD
    of the small (r, r) core between them (exact: the singular values are the product's)."""
    up2, down2 = up.float().flatten(1), down.float().flatten(1)  # (out, r), (r, in * kh * kw)
    q_up, r_up = torch.linalg.qr(up2)
    q_down, r_down = torch.linalg.qr(down2.T)
    u, s, vh = torch.linalg.svd(r_up @ r_down.T)
    shape = (up.shape[0], *down.shape[1:])
    return _truncated(q_up @ u, s, vh @ q_down.T, shape, rule, clamp_quantile)


def _truncated(u, s, vh, shape, rule: RankRule, clamp_quantile: float):
    rank = rule.rank(s)
    up, down = u[:, :rank] * s[:rank], vh[:rank]
    if clamp_quantile < 1.0:  # kohya's extraction: both factors' entries clamped to +-(one quantile of their values)
        values = torch.cat([up.flatten(), down.flatten()])
        values = values[:: len(values) // 2 ** 24 + 1]  # an even sample within torch.quantile's input limit
        limit = abs(float(torch.quantile(values, clamp_quantile)))  # of the signed values, as kohya takes it
        up, down = up.clamp(-limit, limit), down.clamp(-limit, limit)
    total = float(s.double().square().sum())
    kept = float(s[:rank].double().square().sum())
    report = {"rank": rank, "full_rank": len(s), "fro_kept": (kept / total) ** 0.5 if total > 0 else 1.0}
    if len(shape) == 4:
        up, down = up.reshape(shape[0], rank, 1, 1), down.reshape(rank, *shape[1:])
    return up.contiguous(), down.contiguous(), report
