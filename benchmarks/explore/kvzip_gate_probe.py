"""Exploratory: can a same-pass linear gate on each layer's attention input predict KVzip's scores?

Fast KVzip (arXiv 2601.17668) scores tokens in the prefill pass with a small learned gate per
layer on the attention's input hidden states, trained to reproduce KVzip's reconstruction scores.
This probe fits the simplest such gate, ridge regression per (layer, KV head) from the token's
input hidden state to log KVzip score, on some multi-turn SQuAD contexts, and judges it on
held-out contexts by the recall of KVzip's top-k (the metric of eval.scorer_recall) and by the
share of later answers' tokens kept, against kvzip-lite's same-pass scores. Three feature sets:
the hidden state entering attention (Fast KVzip's input), the layer's pre-RoPE q, k and v
projections concatenated (what an attention backend holds, RoPE undone), k, v alone, and
|k|+v: the norm of each rotary pair of k (unchanged by RoPE, so no positions needed) with v.

Usage (Qwen2.5-0.5B, float32, CPU; needs `python -m tangram_sglang.models install qwen2.5-0.5b`):
    python benchmarks/explore/kvzip_gate_probe.py N_TRAIN N_TEST LENGTH
prints a JSON report: per kept fraction, recall of KVzip's top-k and later-answer kept share.
"""

import json
import sys

import numpy as np
import torch

from tangram_sglang.calibrate.observe import ScoreObserver
from tangram_sglang.eval.scorer_recall import (
    answer_positions,
    kept_share,
    kvzip_scores,
    topk_recall,
)
from tangram_sglang.eval.tasks import build_samples, conversation_ids
from tangram_sglang.models import model_path
from tangram_sglang.scoring import get_scorer


def pair_norms(k: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[n, H_kv * head_dim]`` keys -> ``[n, H_kv * head_dim / 2]``: the norm of each rotary
    pair (i, i + head_dim / 2) of each head, which RoPE (a rotation of each pair) leaves
    unchanged: the same features before and after RoPE, so a gate on them needs no positions."""
    k = k.reshape(k.shape[0], -1, 2, head_dim // 2)
    return k.pow(2).sum(2).sqrt().reshape(k.shape[0], -1)


def main() -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if len(sys.argv) != 4 or not all(a.isdigit() and int(a) > 0 for a in sys.argv[1:]):
        sys.exit("usage: kvzip_gate_probe.py N_TRAIN N_TEST LENGTH (positive integers)")
    n_train, n_test, length = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    torch.manual_seed(0)
    path = str(model_path("qwen2.5-0.5b"))
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    layers = model.model.layers
    hidden: dict[int, torch.Tensor] = {}

    def hook(idx):
        def fn(module, args, kwargs):
            hidden[idx] = kwargs["hidden_states"][0].detach().float().cpu()

        return fn

    handles = [
        layer.self_attn.register_forward_pre_hook(hook(i), with_kwargs=True)
        for i, layer in enumerate(layers)
    ]
    proj: dict[tuple[str, int], torch.Tensor] = {}

    def proj_hook(name, idx):
        def fn(module, args, output):
            proj[(name, idx)] = output[0].detach().float().cpu()

        return fn

    for i, layer in enumerate(layers):
        for name in ("q_proj", "k_proj", "v_proj"):
            handles.append(getattr(layer.self_attn, name).register_forward_hook(proj_hook(name, i)))
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    lite = ScoreObserver(model, get_scorer("kvzip-lite"))
    samples = build_samples("multiturn-squad", tok, n_train + n_test, (length,), seed=0)
    data = []
    for s in samples:
        ids = conversation_ids(s, tok).context_ids
        oracle, head = kvzip_scores(model, ids)
        with torch.inference_mode():
            model(input_ids=torch.tensor([ids]))
        feats = {
            "hidden": np.stack([hidden[i][head:].numpy() for i in range(len(layers))]),
            "k+v": np.stack(
                [
                    torch.cat([proj[("k_proj", i)], proj[("v_proj", i)]], -1)[head:].numpy()
                    for i in range(len(layers))
                ]
            ),
            "q+k+v": np.stack(
                [
                    torch.cat([proj[(n, i)] for n in ("q_proj", "k_proj", "v_proj")], -1)[
                        head:
                    ].numpy()
                    for i in range(len(layers))
                ]
            ),
            "|k|+v": np.stack(
                [
                    torch.cat([pair_norms(proj[("k_proj", i)], head_dim), proj[("v_proj", i)]], -1)[
                        head:
                    ].numpy()
                    for i in range(len(layers))
                ]
            ),
        }
        later = [
            p - head
            for turn in s.turns[1:]
            for p in answer_positions(tok, ids, turn.answers)
            if p >= head
        ]
        lite_scores = lite.scores(ids)[..., head:]
        data.append((feats, oracle[..., head:], lite_scores, later))
        print(f"sample {s.sample_id}: {len(ids)} tokens", file=sys.stderr, flush=True)
    for handle in handles:
        handle.remove()
    train, test = data[:n_train], data[n_train:]
    num_layers, num_kv = train[0][1].shape[:2]

    def fit(name):
        weights = []
        for layer in range(num_layers):
            x = np.concatenate([d[0][name][layer] for d in train])  # [N, d]
            x = np.concatenate([x, np.ones((x.shape[0], 1))], axis=1)
            y = np.concatenate([np.log(d[1][layer].T + 1e-6) for d in train])  # [N, H_kv]
            lam = 1e-2 * np.trace(x.T @ x) / x.shape[1]
            weights.append(np.linalg.solve(x.T @ x + lam * np.eye(x.shape[1]), x.T @ y))
        return weights

    def predict(weights, f):
        return np.stack(
            [
                (np.concatenate([f[i], np.ones((f.shape[1], 1))], axis=1) @ weights[i]).T
                for i in range(num_layers)
            ]
        )  # [L, H_kv, n]

    names = ["hidden", "k+v", "q+k+v", "|k|+v"]
    fitted = {name: fit(name) for name in names}
    out = {"n_train": n_train, "n_test": n_test, "length": length, "keep": {}}
    for keep in (0.25, 0.5):
        rec = {f"gate[{n}]": [] for n in names} | {"kvzip-lite": []}
        share = {f"gate[{n}]": [] for n in names} | {"kvzip-lite": [], "kvzip": []}
        for feats, oracle, lite_scores, later in test:
            preds = {f"gate[{n}]": predict(fitted[n], feats[n]) for n in names}
            preds["kvzip-lite"] = np.asarray(lite_scores)
            for k, v in preds.items():
                rec[k].append(topk_recall(oracle, v, keep))
                if later:
                    share[k].append(kept_share(v, later, keep))
            if later:
                share["kvzip"].append(kept_share(oracle, later, keep))
        out["keep"][str(keep)] = {
            "recall_of_kvzip_topk": {k: round(float(np.mean(v)), 4) for k, v in rec.items()},
            "later_answer_kept_share": {k: round(float(np.mean(v)), 4) for k, v in share.items()},
        }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
