"""One layer's selection (``backend.compress.batch_kept_indices``) timed on CPU, one thread, for
three scorers and three batch shapes: the host cost of the selection, the part of the serving
path that is host-bound on a GPU. Run it with ``PYTHONPATH`` at two checkouts to compare them:

    PYTHONPATH=/path/to/checkout python benchmarks/explore/selection_host_cost.py
"""

from __future__ import annotations

import functools
import time

import numpy as np
import torch

from tangram_sglang.backend.compress import batch_kept_indices
from tangram_sglang.scoring import KVzipGateScorer, SnapKVScorer
from tangram_sglang.scoring.kvzip_gate import num_features
from tangram_sglang.scoring.kvzip_lite import KVzipLiteScorer

H_KV, GQA, D = 2, 2, 16
SHAPES = {"bucket": [150, 90, 300, 210, 70, 400, 120, 260], "run": [256] * 4, "whole": [20] * 8}


def best_us(call, repeats: int = 7, number: int = 50) -> float:
    """Fastest of ``repeats`` means over ``number`` calls, microseconds (after 20 warm-ups)."""
    for _ in range(20):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            call()
        times.append((time.perf_counter() - start) / number * 1e6)
    return min(times)


def main() -> None:
    torch.set_num_threads(1)
    weights = np.random.default_rng(0).normal(size=(2, H_KV, num_features(D) + 1)).tolist()
    scorers = {
        "snapkv": SnapKVScorer(obs_window=8, kernel_size=5),
        "kvzip-lite": KVzipLiteScorer(max_queries=32, local_band=4),
        "kvzip-gate": KVzipGateScorer(weights=weights),
    }
    for shape, lengths in SHAPES.items():
        gen = torch.Generator().manual_seed(0)
        total = sum(lengths)
        q = torch.randn(total, GQA * H_KV, D, generator=gen)
        k = torch.randn(total, H_KV, D, generator=gen)
        v = torch.randn_like(k)
        lse = torch.randn(total, GQA * H_KV, generator=gen).abs() + 3
        bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
        kept = [[n if n <= 32 else max(n // (2 + h), 1) for h in range(H_KV)] for n in lengths]
        for name, scorer in scorers.items():
            extra = {"v_new": v, "layer_id": 1} if name == "kvzip-gate" else {}
            call = functools.partial(
                batch_kept_indices,
                scorer,
                q,
                k,
                lse,
                bounds,
                kept,
                0.3,
                2,
                4,
                torch.tensor(kept),
                window_kernel=False,
                **extra,
            )
            print(f"{shape:7s} {name:11s} {best_us(call):8.0f} us")


if __name__ == "__main__":
    main()
