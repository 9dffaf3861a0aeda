"""Run the real model on one sample and observe how much of each KV head the method keeps.

One forward pass of the HF model (transformers, CPU or GPU, float32) per sample. A custom
attention function (registered through ``transformers.AttentionInterface``) sees every layer's
post-RoPE queries and keys before delegating to SDPA, so the scorer runs on exactly what the
attention kernel sees, and only the ``[num_kv_heads, n]`` scores are kept per layer (the full
attention matrix is never built). The LM head is skipped (only the decoder stack runs).

Per-request dynamic allocation (the method as published) then turns the scores into per-head
kept counts at the target ratio, and each head's retention is what :func:`profile.kept_len` would
need to reproduce that count: ``(kept - sink_part - window_part) / rest``.

Allocations (``ALLOCATIONS``):
  ``layer``    AdaKV: per layer, heads compete for ``H_kv * k`` slots, safeguard alpha 0.2.
  ``global``   Tangram "crosslayer": one competition over all heads of all layers (same
               safeguard); the only way a plain SnapKV run shows per-head structure.
  ``pyramid``  PyramidKV's per-layer schedule (heads of a layer equal).
  ``duo``      DuoAttention-style: heads with the most non-local attention keep everything.
  ``uniform``  every head keeps ``k`` (plain SnapKV; gives a flat profile).

This module owns observation only; fitting lives in ``fit.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tangram_sglang.errors import ConfigError
from tangram_sglang.profile import kept_len
from tangram_sglang.scoring import (
    adaptive_select,
    bind_rope,
    is_token_scorer,
    needs_rope,
    pyramid_layer_budget,
    rope_from_hf,
)
from tangram_sglang.scoring.ada_snapkv import ALPHA_SAFEGUARD
from tangram_sglang.scoring.base import Scorer
from tangram_sglang.scoring.duo import nonlocal_mass, retrieval_heads
from tangram_sglang.scoring.kvzip import needs_replay
from tangram_sglang.scoring.snapkv import window_share_of

ALLOCATIONS = ("layer", "global", "pyramid", "duo", "uniform")
DEFAULT_ALLOCATION = {
    "ada-snapkv": "layer",
    "snapkv": "global",
    "pyramidkv": "pyramid",
    "duo": "duo",
    "kvzip-lite": "global",  # KVzip ranks (layer, head, token) triples in one competition
    "kvzip-replay": "global",
    "kvzip-gate": "global",  # predicted log KVzip scores: comparable across layers and heads
    "kvzip": "global",  # KVzip's own scores (the server runs its replay)
}


class ScoreObserver:
    """Captures per-layer scores during a model forward. Build once per model, call per sample.

    Args:
        model: a transformers causal LM (Llama/Qwen2 family) already loaded.
        scorer: the scorer to apply at every layer.
    """

    def __init__(self, model: Any, scorer: Scorer, kvzip_cache: Any = None) -> None:
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        self.model = model
        self.kvzip_cache = kvzip_cache  # folder of cached KVzip scores (replay scorers), or None
        self.scorer = bind_rope(scorer, rope_from_hf(model)) if needs_rope(scorer) else scorer
        self.num_layers = int(model.config.num_hidden_layers)
        self._scores: list[torch.Tensor | None] = [None] * self.num_layers
        self._sdpa = sdpa_attention_forward
        self.attn_name = f"tangram_observe_{id(self):x}"
        AttentionInterface.register(self.attn_name, self._attend)
        AttentionMaskInterface.register(self.attn_name, sdpa_mask)

    def _attend(self, module: Any, query: torch.Tensor, key: torch.Tensor, *args: Any, **kw: Any):
        # query [1, Hq, n, D], key and value [1, H_kv, n, D]; query and key post-RoPE (HF calls
        # us after RoPE), value the first positional argument after them.
        scale = kw.get("scaling") or query.shape[-1] ** -0.5
        if is_token_scorer(self.scorer) and window_share_of(self.scorer):  # gate + window
            scores = self.scorer.union_scores(
                module.layer_idx, key[0], args[0][0], query[0], float(scale)
            )
        elif is_token_scorer(self.scorer):
            scores = self.scorer.token_scores(module.layer_idx, key[0], args[0][0])
        else:
            w = self.scorer.obs_window
            scores = self.scorer.score(query[0, :, -w:], key[0], float(scale))
        self._scores[module.layer_idx] = scores.float().cpu()
        return self._sdpa(module, query, key, *args, **kw)

    @torch.inference_mode()
    def scores(self, input_ids: Sequence[int]) -> np.ndarray:
        """float32 ``[num_layers, num_kv_heads, n]``: the scorer's output at every layer.

        Raises:
            ConfigError: the model's attention did not go through the observer (unsupported
                architecture).
        """
        if needs_replay(self.scorer):  # KVzip's own reconstruction scores (kvpress; the
            # chat-template head it leaves unscored stays in, at 0: docs/scorers.md)
            from tangram_sglang.calibrate.gate import kvzip_scores_cached

            return kvzip_scores_cached(self.model, list(input_ids), self.kvzip_cache)[0]
        self._scores = [None] * self.num_layers
        device = next(self.model.parameters()).device
        ids = torch.tensor([list(input_ids)], dtype=torch.long, device=device)
        previous = self.model.config._attn_implementation
        self.model.config._attn_implementation = self.attn_name
        try:
            self.model.model(input_ids=ids, use_cache=False)  # decoder stack only, no LM head
        finally:
            self.model.config._attn_implementation = previous
        if any(s is None for s in self._scores):
            raise ConfigError(
                f"{type(self.model).__name__}: some layers did not call the attention interface; "
                "calibration supports HF Llama/Qwen2-style models"
            )
        return torch.stack(self._scores).numpy()  # type: ignore[arg-type]


def head_retention(
    scores: np.ndarray,
    allocation: str,
    ratio: float,
    sink_tokens: int,
    recent_window: int,
    obs_window: int,
    alpha_safeguard: float = ALPHA_SAFEGUARD,
) -> np.ndarray:
    """Per-head retention of one sample under a per-request dynamic allocation.

    Args:
        scores: float32 ``[num_layers, num_kv_heads, n]`` from :meth:`ScoreObserver.scores`.
        allocation: one of ``ALLOCATIONS``.
        ratio: target ratio in (0, 1] (of the tokens beyond sinks and window).
        sink_tokens: always-kept first tokens.
        recent_window: always-kept last tokens.
        obs_window: the scorer's observation window (for ``pyramid`` and ``duo``).
        alpha_safeguard: AdaKV's per-head floor (``layer`` and ``global``).

    Returns:
        float64 ``[num_layers, num_kv_heads]`` in [0, 1]: the ratio each head needed.

    Raises:
        ConfigError: unknown allocation.
    """
    num_layers, num_kv_heads, n = scores.shape
    k = kept_len(n, ratio, sink_tokens, recent_window)
    prot = min(sink_tokens, n) + min(recent_window, n - min(sink_tokens, n))
    rest = n - prot
    t = torch.from_numpy(scores)
    if allocation == "layer":
        counts = adaptive_select(t, k, alpha_safeguard, sink_tokens, recent_window).sum(-1)
    elif allocation == "global":
        flat = t.reshape(1, num_layers * num_kv_heads, n)
        mask = adaptive_select(flat, k, alpha_safeguard, sink_tokens, recent_window)
        counts = mask.sum(-1).reshape(num_layers, num_kv_heads)
    elif allocation == "pyramid":
        per_layer = [
            pyramid_layer_budget(i, num_layers, n, ratio, obs_window) for i in range(num_layers)
        ]
        counts = torch.tensor(per_layer).clamp(prot, n)[:, None].expand(num_layers, num_kv_heads)
    elif allocation == "duo":
        mass = nonlocal_mass(t, sink_tokens, recent_window, obs_window)
        counts = torch.where(retrieval_heads(mass, ratio), n, prot)
    elif allocation == "uniform":
        counts = torch.full((num_layers, num_kv_heads), k)
    else:
        raise ConfigError(f"allocation={allocation!r} is unknown; use one of {ALLOCATIONS}")
    if rest <= 0:
        return np.ones((num_layers, num_kv_heads))
    return ((counts.double() - prot) / rest).clamp(0.0, 1.0).numpy()
