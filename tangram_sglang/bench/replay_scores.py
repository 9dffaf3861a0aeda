"""KVzip's replay scores of one segment, one layer: the Triton kernel against the torch scorer.

Times ``kernels.replay_scores.replay_max_scores`` (plus the GQA max) and
``scoring.kvzip.KVzipScorer.score`` (float32 torch ops) on the same random bfloat16 replay of
Llama-3.1-8B's head shapes (32 query heads, 8 KV heads, head_dim 128): ``--tokens`` segment
tokens and as many replay tokens (the prompt is a few dozen more in serving), the shape of one
chunk of a long prefill. Prints one JSON line: milliseconds per call (``triton.testing.do_bench``
medians), the speedup, and how many of each KV head's top quarter of tokens the two agree on.

    python -m tangram_sglang.bench.replay_scores --tokens 8192

Needs CUDA.
"""

from __future__ import annotations

import argparse
import json

import torch

from tangram_sglang.bench.decode_step import at_least


def main(argv: list[str] | None = None) -> None:
    """Run the comparison and print the JSON line (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--tokens", type=at_least(1), default=8192, help="segment tokens (= replay tokens)"
    )
    ap.add_argument("--qo-heads", type=at_least(1), default=32, help="query heads")
    ap.add_argument("--kv-heads", type=at_least(1), default=8, help="KV heads (divide --qo-heads)")
    ap.add_argument("--head-dim", type=at_least(16), default=128, help="a power of two, 16 to 128")
    args = ap.parse_args(argv)
    from tangram_sglang.kernels.replay_scores import MAX_HEAD_DIM, replay_max_scores

    dim = args.head_dim
    if dim & (dim - 1) or dim > MAX_HEAD_DIM:
        ap.error(f"--head-dim {dim}: want a power of two from 16 to {MAX_HEAD_DIM} (the kernel's)")
    if args.qo_heads % args.kv_heads:
        ap.error(f"--qo-heads {args.qo_heads} must be a multiple of --kv-heads {args.kv_heads}")
    if not torch.cuda.is_available():
        raise SystemExit("bench.replay_scores needs CUDA (the kernel and its timing run there)")
    import triton.testing

    from tangram_sglang.scoring.kvzip import KVzipScorer
    from tangram_sglang.scoring.snapkv import reduce_gqa

    n = m = args.tokens
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape_q = (args.qo_heads, m, args.head_dim)
    q = torch.randn(shape_q, generator=gen, device="cuda").bfloat16()
    k = torch.randn((args.kv_heads, n, args.head_dim), generator=gen, device="cuda").bfloat16()
    lse = torch.randn((args.qo_heads, m), generator=gen, device="cuda").abs() + 8.0
    scale = args.head_dim**-0.5
    scorer = KVzipScorer()

    def kernel() -> torch.Tensor:
        return reduce_gqa(replay_max_scores(q, k, lse, scale), args.kv_heads, "max")

    def torch_path() -> torch.Tensor:
        return scorer.score(q, k, scale, lse)

    got, want = kernel(), torch_path()
    kept = n // 4
    agree = min(
        len(set(got[h].topk(kept).indices.tolist()) & set(want[h].topk(kept).indices.tolist()))
        / kept
        for h in range(args.kv_heads)
    )
    ms_kernel = triton.testing.do_bench(kernel)
    ms_torch = triton.testing.do_bench(torch_path)
    print(
        json.dumps(
            {
                "tokens": n,
                "shape": [args.qo_heads, args.kv_heads, args.head_dim],
                "ms_kernel": round(ms_kernel, 3),
                "ms_torch": round(ms_torch, 3),
                "speedup": round(ms_torch / ms_kernel, 2),
                "top_quarter_agreement_min": round(agree, 4),
                "device": torch.cuda.get_device_name(),
            }
        )
    )


if __name__ == "__main__":
    main()
