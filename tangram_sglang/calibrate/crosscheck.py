"""Cross-check our SnapKV / AdaKV / PyramidKV selections against NVIDIA kvpress, per head.

One forward pass of the real model runs with kvpress's press hooked in (kvpress 0.5.5, installed
``--no-deps``, see README) and, on the same forward, our :class:`ScoreObserver` on the same
post-RoPE queries and keys. kvpress's choice per (layer, KV head) is read back from the cache it
compressed (SnapKV, PyramidKV: rows matched to the uncompressed keys) or from the pruned indices
it records (AdaKV: ``module.masked_key_indices``). Ours comes from :func:`select_kept`,
:func:`pyramid_layer_budget` and :func:`adaptive_select` with the same window, kernel size and
ratio (kvpress has no sinks: ``sink_tokens = 0``; its window scores ``max + 1`` = our
``recent_window = window``).

Overlap of a head = |ours & kvpress| / kept count. Differences are classified as *ties*: the
swapped tokens' scores equal the head's (or layer's, for AdaKV) k-th score within ``1e-6``
relative, so the two top-k's are equally valid.

CLI: ``python -m tangram_sglang.calibrate.crosscheck --model-path smollm2 --tokens 512``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tangram_sglang.calibrate.observe import ScoreObserver
from tangram_sglang.scoring import (
    SnapKVScorer,
    adaptive_select,
    pyramid_layer_budget,
    select_kept,
)
from tangram_sglang.scoring.ada_snapkv import ALPHA_SAFEGUARD

METHODS = ("snapkv", "adakv", "pyramidkv")
_TIE_RTOL = 1e-6


@dataclass(frozen=True, slots=True)
class Overlap:
    """Per-head agreement of one method.

    Attributes:
        method: ``snapkv``, ``adakv`` or ``pyramidkv``.
        overlap: float64 ``[num_layers, num_kv_heads]``, share of kvpress's kept tokens we keep.
        num_diff_tokens: tokens kept by exactly one side (over all heads).
        num_tie_diff_tokens: of those, tokens whose score ties the selection threshold.
    """

    method: str
    overlap: np.ndarray
    num_diff_tokens: int
    num_tie_diff_tokens: int

    @property
    def mean(self) -> float:
        """Mean overlap over heads."""
        return float(self.overlap.mean())


def kvpress_masks(
    model: Any, input_ids: torch.Tensor, method: str, ratio: float, window: int, kernel: int
) -> np.ndarray:
    """bool ``[num_layers, num_kv_heads, n]``: the tokens kvpress keeps.

    Raises:
        ImportError: kvpress is not installed.
    """
    import kvpress
    from transformers import DynamicCache

    snap = kvpress.SnapKVPress(compression_ratio=1 - ratio, window_size=window, kernel_size=kernel)
    press = {
        "snapkv": snap,
        "adakv": kvpress.AdaKVPress(snap, alpha_safeguard=ALPHA_SAFEGUARD),
        "pyramidkv": kvpress.PyramidKVPress(
            compression_ratio=1 - ratio, window_size=window, kernel_size=kernel
        ),
    }[method]
    layers = model.model.layers
    n = input_ids.shape[1]
    before: dict[int, torch.Tensor] = {}

    def grab(module, args, kwargs, output):  # runs before kvpress's hook: uncompressed keys
        before[module.layer_idx] = kwargs["past_key_values"].layers[module.layer_idx].keys.clone()

    handles = [layer.self_attn.register_forward_hook(grab, with_kwargs=True) for layer in layers]
    cache = DynamicCache(config=model.config)
    try:
        with torch.inference_mode(), press(model):
            model.model(
                input_ids=input_ids,
                past_key_values=cache,
                use_cache=True,
                cache_position=torch.arange(n, device=input_ids.device),
            )
    finally:
        for h in handles:
            h.remove()
    masks = []
    for i, layer in enumerate(layers):
        if method == "adakv":
            _, heads, seq = layer.self_attn.masked_key_indices
            del layer.self_attn.masked_key_indices
            mask = torch.ones(before[i].shape[1], n, dtype=torch.bool)
            mask[heads.cpu(), seq.cpu()] = False
        else:
            mask = _match_rows(before[i][0], cache.layers[i].keys[0])
        masks.append(mask)
    return torch.stack(masks).numpy()


def _match_rows(full: torch.Tensor, kept: torch.Tensor, block: int = 256) -> torch.Tensor:
    """bool ``[H, n]``: which rows of ``full [H, n, D]`` appear (exactly) in ``kept [H, k, D]``."""
    mask = torch.zeros(full.shape[:2], dtype=torch.bool)
    full, kept = full.cpu(), kept.cpu()
    for start in range(0, kept.shape[1], block):  # bounded memory: [H, block, n] comparisons
        chunk = kept[:, start : start + block]
        eq = (chunk[:, :, None, :] == full[:, None, :, :]).all(-1)
        mask |= eq.any(1)
    return mask


def our_masks(scores: np.ndarray, method: str, ratio: float, window: int) -> np.ndarray:
    """bool ``[num_layers, num_kv_heads, n]``: the tokens our selection keeps."""
    num_layers, _, n = scores.shape
    t = torch.from_numpy(scores)
    if method == "adakv":
        k = max(1, int(n * (1 - (1 - ratio))))
        return adaptive_select(t, k, ALPHA_SAFEGUARD, 0, window).numpy()
    out = np.zeros(scores.shape, dtype=bool)
    for layer in range(num_layers):
        if method == "pyramidkv":
            k = pyramid_layer_budget(layer, num_layers, n, 1 - (1 - ratio), window)
        else:
            k = max(1, int(n * (1 - (1 - ratio))))
        idx = select_kept(t[layer], k, 0, window)
        out[layer, np.arange(t.shape[1])[:, None], idx.numpy()] = True
    return out


def compare(
    model: Any,
    input_ids: torch.Tensor,
    ratio: float,
    window: int,
    kernel: int,
    methods: tuple[str, ...] = METHODS,
) -> list[Overlap]:
    """Run kvpress and ours on the same input; per-method per-head overlap."""
    scorer = SnapKVScorer(obs_window=window, kernel_size=kernel)
    observer = ScoreObserver(model, scorer)
    scores = observer.scores(input_ids[0].tolist())
    results = []
    for method in methods:
        theirs = kvpress_masks(model, input_ids, method, ratio, window, kernel)
        ours = our_masks(scores, method, ratio, window)
        kept = theirs.sum(-1)
        overlap = (ours & theirs).sum(-1) / kept
        diff = ours ^ theirs
        results.append(
            Overlap(method, overlap, int(diff.sum()), _tie_diffs(scores, ours, theirs, method))
        )
    return results


def _tie_diffs(scores: np.ndarray, ours: np.ndarray, theirs: np.ndarray, method: str) -> int:
    """Differing tokens whose score equals the selection threshold (a tie), within 1e-6 rel."""
    diff = ours ^ theirs
    if method == "adakv":  # one threshold per layer, over all heads
        kth = np.where(theirs, scores, np.inf).reshape(scores.shape[0], -1).min(-1)[:, None, None]
    else:
        kth = np.where(theirs, scores, np.inf).min(-1, keepdims=True)
    tie = np.isclose(scores, kth, rtol=_TIE_RTOL, atol=0.0)
    return int((diff & tie).sum())


def main(argv: list[str] | None = None) -> int:
    """Print the overlap table for a model on real text (ShareGPT) at the given settings."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tangram_sglang.calibrate.cli import resolve_model_path
    from tangram_sglang.calibrate.data import load_samples

    p = argparse.ArgumentParser(prog="python -m tangram_sglang.calibrate.crosscheck")
    p.add_argument("--model-path", default="smollm2")
    p.add_argument("--dataset", default="sharegpt")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--ratios", default="0.25,0.5")
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--kernel", type=int, default=5)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    path = resolve_model_path(args.model_path)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa"
    ).to(args.device)
    samples = load_samples(args.dataset, tok, args.num_samples, args.tokens, args.tokens)
    for sample in samples:
        ids = torch.tensor([sample.input_ids], device=args.device)
        for ratio in (float(r) for r in args.ratios.split(",")):
            for res in compare(model.eval(), ids, ratio, args.window, args.kernel):
                print(
                    f"{sample.sample_id} n={ids.shape[1]} ratio={ratio} {res.method:9s} "
                    f"overlap mean {res.mean:.5f} min {res.overlap.min():.5f} "
                    f"diff tokens {res.num_diff_tokens} (ties {res.num_tie_diff_tokens})"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
