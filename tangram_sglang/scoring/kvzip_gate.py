"""KVzip-gate: KVzip's query-agnostic scores, predicted in the prefill pass by a linear gate.

KVzip (Kim et al. 2025, arXiv 2505.23416) scores each KV pair of a context by the largest
attention it receives while the model reconstructs the context ("Repeat the previous context."
followed by the context again): a second forward over the whole context. Its kept tokens serve
questions asked later, which the SnapKV family (scored by the segment's last queries) does not.
Fast KVzip (arXiv 2601.17668) replaces the second forward by a small gate per layer trained to
reproduce KVzip's scores from the first pass.

This scorer is the simplest such gate that an attention backend can run: per layer and KV head,
a linear function of the token's own key and value,

    score[l, h, j] = W[l, h, :F] . phi(k_j, v_j) + W[l, h, F],
    phi(k, v) = (|(k_i, k_{i + D/2})| for i < D/2, v_0 .. v_{D-1}),   F = 3 D / 2,

fitted offline (:func:`fit_gate`, ridge regression on ``log`` KVzip scores of calibration
contexts; ``calibrate --scorer kvzip-gate``) and shipped in the profile
(``provenance.scorer_options.weights``). The key enters only through the norm of each rotary
pair (i, i + D/2): RoPE rotates each such pair by an angle of the position (the "neox" layout
of Llama, Qwen2 and SmolLM2), so those norms are the same before and after RoPE, and the gate
reads the post-RoPE keys the backend holds without knowing positions. On held-out multi-turn
SQuAD contexts of Qwen2.5-0.5B a gate on these features agreed with KVzip's top quarter on 62% of
the tokens, kvzip-lite on 41% (benchmarks/RESULTS.md, issue 20 probe; the probe regressed each
head on all of its layer's KV heads' features, this scorer on its own head's).

Cost per layer: one ``[T, H_kv, F] x [H_kv, F]`` product over the batch's new tokens (no
queries, no softmax): smaller than any attention-based scorer.

Source: KVzip (arXiv 2505.23416) §3 (the reconstruction score this gate imitates); Fast KVzip
(arXiv 2601.17668) (a gate trained on KVzip's scores); RoPE (Su et al., arXiv 2104.09864: a
rotation of each pair of dimensions, which preserves its norm).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tangram_sglang.errors import ConfigError
from tangram_sglang.host_copy import host_to_device
from tangram_sglang.scoring.base import register_scorer
from tangram_sglang.scoring.snapkv import check_window_share, with_window

RIDGE = 1e-2  # ridge strength, relative to the mean diagonal of X^T X (dimensionless)
SCORE_FLOOR = 1e-6  # added to KVzip's scores before the log (its scores lie in [0, 1])


def num_features(head_dim: int) -> int:
    """Features per token and KV head: ``head_dim / 2`` rotary-pair norms of k and ``head_dim``
    entries of v."""
    return head_dim // 2 + head_dim


def gate_features(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The gate's input per token and KV head.

    Args:
        k: ``[..., D]`` keys (before or after RoPE: the result is the same), D even.
        v: ``[..., D]`` values, same leading shape.

    Returns:
        float32 ``[..., 3 D / 2]``: the norm of each rotary pair ``(k_i, k_{i + D/2})``, then v.

    Raises:
        ConfigError: shapes that differ or an odd head_dim.
    """
    if k.shape != v.shape or k.shape[-1] % 2:
        raise ConfigError(
            f"kvzip-gate: k {list(k.shape)} and v {list(v.shape)} must have the same shape and "
            "an even head_dim"
        )
    half = k.shape[-1] // 2
    kf = k.float()
    norms = torch.sqrt(kf[..., :half].square() + kf[..., half:].square())
    return torch.cat([norms, v.float()], dim=-1)


def fit_gate(
    features: Sequence[np.ndarray], scores: Sequence[np.ndarray], ridge: float = RIDGE
) -> np.ndarray:
    """Ridge-regression gate weights from KVzip's scores, one linear map per (layer, KV head).

    Args:
        features: per layer, float ``[N, H_kv, F]``: :func:`gate_features` of the ``N``
            calibration tokens (all contexts concatenated).
        scores: per layer, float ``[N, H_kv]``: KVzip's score of the same tokens (in [0, 1]);
            the target is ``log(score + SCORE_FLOOR)``.
        ridge: ridge strength relative to the mean diagonal of the centred ``X^T X`` (> 0).

    Returns:
        float32 ``[L, H_kv, F + 1]``: the weights, bias last.

    Raises:
        ConfigError: no layers, no tokens, shapes that do not match, or ``ridge <= 0``.

    Source: ridge regression on centred features and targets (closed form
    ``w = (Xc^T Xc + lambda I)^-1 Xc^T yc``, intercept ``mean(y) - mean(x) . w``: the intercept
    is not penalised), ``lambda = ridge * trace(Xc^T Xc) / F``.
    """
    if not features or len(features) != len(scores) or not ridge > 0:
        raise ConfigError(
            f"fit_gate: {len(features)} feature and {len(scores)} score layers (need the same "
            f"number, > 0) and ridge {ridge} (> 0)"
        )
    out = []
    for layer, (x_all, y_all) in enumerate(zip(features, scores, strict=True)):
        x_all, y_all = np.asarray(x_all, np.float64), np.asarray(y_all, np.float64)
        if x_all.ndim != 3 or y_all.shape != x_all.shape[:2] or x_all.shape[0] == 0:
            raise ConfigError(
                f"fit_gate: layer {layer}: features {list(x_all.shape)} and scores "
                f"{list(y_all.shape)} must be [N, H_kv, F] and [N, H_kv] with N > 0"
            )
        heads = []
        for h in range(x_all.shape[1]):
            # Centred, so the penalty shrinks the feature weights only, never the intercept
            # (the features are norms and values far from 0, the targets logs near -10).
            x_mean = x_all[:, h].mean(axis=0)
            y = np.log(np.clip(y_all[:, h], 0.0, None) + SCORE_FLOOR)
            x = x_all[:, h] - x_mean
            gram = x.T @ x
            lam = ridge * max(float(np.trace(gram)) / gram.shape[0], 1e-12)
            w = np.linalg.solve(gram + lam * np.eye(gram.shape[0]), x.T @ (y - y.mean()))
            heads.append(np.append(w, y.mean() - x_mean @ w))
        out.append(heads)
    return np.asarray(out, np.float32)


@dataclass(frozen=True, slots=True, eq=False)
class KVzipGateScorer:
    """Per-token scores from the gate of :func:`fit_gate` (module docstring).

    Attributes:
        weights: nested ``[L][H_kv][3 D / 2 + 1]`` floats (the profile's
            ``scorer_options.weights``); None until ``calibrate`` fits them.
        obs_window: 0: the gate reads no queries (the scorer protocol's field).
        window_share: 0 (off) or in ``[0.001, 0.99]``; above 0 each head keeps the union of
            its top tokens by
            the gate and by SnapKV's observation window (the segment's last 32 queries, which
            the gate then reads), the window getting about this share of the head's budget
            (:meth:`union_scores`, ``scoring.select.window_union``). 0: off.
    """

    name: str = "kvzip-gate"
    weights: Any = None
    obs_window: int = 0
    window_share: float = 0.0
    _tables: dict = field(default_factory=dict, repr=False, metadata={"runtime": True})

    def __post_init__(self) -> None:
        if self.obs_window != 0:
            raise ConfigError(
                f"kvzip-gate: obs_window={self.obs_window!r} must be 0 (the gate reads no "
                "queries; leave --obs-window unset)"
            )
        check_window_share(self.window_share)
        if self.weights is None:
            return
        try:
            w = np.asarray(self.weights, dtype=np.float64)
        except (TypeError, ValueError, OverflowError) as exc:  # Overflow: an int past float64
            raise ConfigError(
                f"kvzip-gate: scorer_options.weights is not a [num_layers][num_kv_heads]"
                f"[3 * head_dim / 2 + 1] array of numbers ({exc}); calibrate a profile with "
                "--scorer kvzip-gate"
            ) from None
        if w.ndim != 3 or w.shape[-1] < 4 or (w.shape[-1] - 1) % 3:
            raise ConfigError(
                f"kvzip-gate: scorer_options.weights has shape {list(w.shape)}; it must be "
                "[num_layers][num_kv_heads][3 * head_dim / 2 + 1] finite floats (calibrate a "
                "profile with --scorer kvzip-gate)"
            )
        with np.errstate(over="ignore"):  # the gate runs in float32: 1e300 is inf there
            finite = np.isfinite(w.astype(np.float32))
        if not finite.all():
            index = tuple(int(i) for i in np.argwhere(~finite)[0])
            where = "".join(f"[{i}]" for i in index)
            count = int((~finite).sum())
            raise ConfigError(
                f"kvzip-gate: scorer_options.weights{where} is {w[index]}: the gate weights must "
                f"be finite numbers ({count} non-finite in float32, from a failed fit or an edit); "
                "calibrate the profile again with --scorer kvzip-gate"
            )

    @property
    def shape(self) -> tuple[int, int, int] | None:
        """``(num_layers, num_kv_heads, head_dim)`` the weights fit, or None without weights."""
        if self.weights is None:
            return None
        w = np.asarray(self.weights)
        return int(w.shape[0]), int(w.shape[1]), (int(w.shape[2]) - 1) * 2 // 3

    def check_model(self, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        """The weights exist and fit the model.

        Raises:
            ConfigError: no weights, or weights for another geometry (names both).
        """
        if self.shape is None:
            raise ConfigError(
                "kvzip-gate has no gate weights: its profile must carry "
                "provenance.scorer_options.weights (calibrate one with --scorer kvzip-gate)"
            )
        if self.shape != (num_layers, num_kv_heads, head_dim):
            raise ConfigError(
                f"kvzip-gate weights are for (layers, KV heads, head_dim) {self.shape}, the "
                f"model has {(num_layers, num_kv_heads, head_dim)}; calibrate a profile for "
                "this model with --scorer kvzip-gate"
            )

    def _table(self, device: torch.device) -> torch.Tensor:
        table = self._tables.get(device)
        if table is None:
            if self.weights is None:
                self.check_model(0, 0, 0)  # raises: no weights
            # pinned and non-blocking: the first extend batch of a server does not wait here
            table = host_to_device(np.asarray(self.weights, np.float32), device)
            self._tables[device] = table
        return table

    def token_scores(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Scores of every token at one layer (higher = keep).

        Args:
            layer: layer index (< the weights' ``num_layers``).
            k: ``[..., H_kv, n, D]`` keys (post-RoPE is fine: only rotary-pair norms enter).
            v: ``[..., H_kv, n, D]`` values.

        Returns:
            float32 ``[..., H_kv, n]`` on the inputs' device: the predicted ``log`` KVzip score.

        Raises:
            ConfigError: no weights, a layer out of range or a head count/head_dim the weights
                do not fit.
        """
        table = self._table(k.device)
        num_layers, num_kv_heads, width = table.shape
        if not 0 <= layer < num_layers or k.shape[-3] != num_kv_heads:
            raise ConfigError(
                f"kvzip-gate: layer {layer} with {k.shape[-3]} KV heads; the weights cover "
                f"{num_layers} layers of {num_kv_heads} KV heads"
            )
        if k.shape != v.shape or k.shape[-1] % 2:
            gate_features(k, v)  # raises, naming both shapes
        if num_features(k.shape[-1]) + 1 != width:
            raise ConfigError(
                f"kvzip-gate: head_dim {k.shape[-1]} gives {num_features(k.shape[-1])} "
                f"features; the weights take {width - 1}"
            )
        w = table[layer]  # [H_kv, F + 1]
        if k.dim() != 3:
            feats = gate_features(k, v)  # [..., H_kv, n, F]
            return torch.einsum("...hnf,hf->...hn", feats, w[:, :-1]) + w[:, -1:]
        # The serving path ([H_kv, n, D], one call per layer): the same sum in two batched
        # products with the bias folded in, no concatenated feature tensor (7 ops that do work
        # on bfloat16 k and v, was 9). The sum's order differs from the einsum's: scores move by
        # float32 rounding (about 1e-5), which can flip near-ties between tokens.
        half = k.shape[-1] // 2
        norms = k.float().unflatten(-1, (2, half)).square().sum(-2).sqrt_()  # [H_kv, n, D/2]
        out = torch.baddbmm(w[:, -1:, None], norms, w[:, :half, None])  # [H_kv, n, 1]
        return torch.baddbmm(out, v.float(), w[:, half:-1, None]).squeeze(-1)

    def union_scores(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        q_obs: torch.Tensor,
        sm_scale: float,
        lse_obs: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The scores a segment's tokens are selected by: :meth:`token_scores`, fused with the
        observation window's when :attr:`window_share` is above 0 (``scoring.snapkv.
        with_window``); the HF side's form (calibration's observer, the eval harness, the
        serving path's oracle ``backend.compress.reference_kept_indices``).

        Args:
            layer: layer index.
            k, v: ``[..., H_kv, n, D]`` the segment's post-RoPE keys and its values.
            q_obs: ``[..., H_q, w, D]`` its last ``w`` post-RoPE queries (``w >= 32`` or the
                whole segment); not read when :attr:`window_share` is 0.
            sm_scale: softmax scale.
            lse_obs: optional float32 ``[..., H_q, w]`` normaliser over history + segment.

        Returns:
            float32 ``[..., H_kv, n]``.
        """
        scores = self.token_scores(layer, k, v)
        if not self.window_share:
            return scores
        return with_window(scores, self.window_share, q_obs, k, sm_scale, lse_obs)

    def score(
        self,
        q_obs: torch.Tensor,
        k_seg: torch.Tensor,
        sm_scale: float,
        lse_obs: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Not available: the gate needs the values and the layer (:meth:`token_scores`).

        Raises:
            ConfigError: always, naming the method to call.
        """
        raise ConfigError(
            "kvzip-gate scores a token from its key and value at a given layer: call "
            "token_scores(layer, k, v), not score(q_obs, k_seg, ...)"
        )


def is_token_scorer(scorer: object) -> bool:
    """Whether ``scorer`` scores tokens from their own k and v (``token_scores``), not from
    queries."""
    return callable(getattr(scorer, "token_scores", None))


register_scorer("kvzip-gate", KVzipGateScorer)
