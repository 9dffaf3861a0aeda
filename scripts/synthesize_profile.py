#!/usr/bin/env python3
"""Synthesize a budget profile for a model we cannot calibrate here, from calibrated profiles.

Throughput does not depend on the weights once budgets are static (issue 7), so a dummy-weight
model of the right shape needs a profile with a realistic per-head ratio distribution, not a
calibrated one. This script transplants the calibrated distribution by relative depth::

    for each target layer l (of L):  x = l / (L - 1)
        pool = the ratios of every source profile's layer round(x * (L_src - 1)), all KV heads
        r[l, :] = H_kv draws from pool (with replacement, seeded)

so early/late-layer structure and the per-layer spread of the sources carry over, then groups the
heads (budget-aware clustering, ``BudgetProfile.with_grouping``). Sinks, window, scorer and its
options come from the first source, except a ``kvzip-gate`` source's gate weights, which
fit only the source's geometry: the synthetic profile gets seeded random weights of the target's
shape (``[L, H_kv, 3 D / 2 + 1]``), which cost what real ones cost and select arbitrary tokens
(for throughput measurements only, like the dummy weights). ``--tangram-target-ratio``
(``BudgetProfile.rescaled``) moves the mean at serve time. The target model's identity (with its
config fingerprint) is read from ``--config`` with transformers' ``AutoConfig``, as the server
reads it.

    python scripts/synthesize_profile.py --config calibration/synthetic/llama3.1-8b-dummy \
        --source calibration/smollm2/ada-snapkv-r0.25.json \
        --source calibration/qwen2.5-0.5b/ada-snapkv-r0.25.json \
        --output calibration/synthetic/llama3.1-8b-ada-snapkv-r0.25.json

Source: issue 7 item 3 ("a profile synthesized from the calibrated ratio distribution").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tangram_sglang.errors import TangramError  # noqa: E402
from tangram_sglang.grouping import HeadGrouping  # noqa: E402
from tangram_sglang.profile import BudgetProfile, ModelIdentity  # noqa: E402


def transplant(
    sources: list[BudgetProfile], num_layers: int, num_kv_heads: int, seed: int
) -> np.ndarray:
    """float64 ``[num_layers, num_kv_heads]`` ratios drawn by relative depth from ``sources``."""
    rng = np.random.default_rng(seed)
    ratio = np.empty((num_layers, num_kv_heads))
    for layer in range(num_layers):
        x = layer / max(num_layers - 1, 1)
        pool = np.concatenate([s.ratio[round(x * (s.model.num_layers - 1))] for s in sources])
        ratio[layer] = rng.choice(pool, size=num_kv_heads, replace=True)
    return ratio


def synthesize(
    config_dir: Path, source_paths: list[Path], heads_per_group: int, scope: str, seed: int
) -> BudgetProfile:
    """The synthetic profile for the model of ``config_dir`` (see the module docstring)."""
    from transformers import AutoConfig

    model = ModelIdentity.from_hf_config(AutoConfig.from_pretrained(str(config_dir)))
    sources = [BudgetProfile.load(p) for p in source_paths]
    ratio = transplant(sources, model.num_layers, model.num_kv_heads, seed)
    first = sources[0]
    provenance = {
        "source": "synthetic: calibrated ratios transplanted by relative layer depth",
        "command": " ".join(sys.argv),
        "sources": [str(p) for p in source_paths],
        "seed": seed,
        "source_mean_ratio": [round(s.mean_kept_fraction(), 4) for s in sources],
        "scorer_options": first.provenance.get("scorer_options"),
    }
    if first.scorer == "kvzip-gate":
        from tangram_sglang.scoring.kvzip_gate import num_features

        rng = np.random.default_rng(seed)
        shape = (model.num_layers, model.num_kv_heads, num_features(model.head_dim) + 1)
        weights = np.round(rng.normal(scale=0.05, size=shape), 4).tolist()
        provenance["scorer_options"] = {**(provenance["scorer_options"] or {}), "weights": weights}
        provenance["gate_weights"] = "random, seeded (throughput only: the dummy model's shape)"

    return BudgetProfile(
        model=model,
        scorer=first.scorer,
        target_ratio=first.target_ratio,
        ratio=ratio,
        sink_tokens=first.sink_tokens,
        recent_window=first.recent_window,
        grouping=HeadGrouping.build(ratio, heads_per_group, scope),
        provenance=provenance,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="folder with config.json")
    parser.add_argument(
        "--source",
        type=Path,
        action="append",
        required=True,
        help="calibrated profile (repeat for several)",
    )
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--page-group-size", type=int, default=4, help="H_p (default 4)")
    parser.add_argument("--scope", choices=["global", "per_layer"], default="global")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        profile = synthesize(args.config, args.source, args.page_group_size, args.scope, args.seed)
    except (TangramError, OSError, ValueError) as exc:
        print(f"synthesize_profile: error: {exc}", file=sys.stderr)
        return 2
    profile.save(args.output)
    ratio = profile.ratio
    groups = profile.grouping
    print(
        f"{args.output}: {profile.model.architecture} {ratio.shape[0]}x{ratio.shape[1]} "
        f"mean ratio {ratio.mean():.3f} (min {ratio.min():.3f}, max {ratio.max():.3f}), "
        f"{groups.num_head_groups} head groups of {groups.heads_per_group}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
