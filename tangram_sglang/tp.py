"""Tensor parallelism: what each TP rank holds of a budget profile, its head groups and budgets.

SGLang's tensor parallelism (``--tp-size N``) shards attention by heads: rank ``r`` holds query
heads ``[r*Q/N, (r+1)*Q/N)`` and KV heads ``[r*K/N, (r+1)*K/N)`` of every layer
(``QKVParallelLinear``: ``start_idx = tp_rank * shard_size``; the attention layer's
``tp_k_head_num = K/N``), its own KV pool, and its own scheduler that makes the same decisions
as every other rank's from the same inputs (rank 0 broadcasts the requests; nothing else is
exchanged). Under ``--tangram`` each rank therefore runs a whole Tangram pool over its own heads:

* **Head groups per rank.** Budget-aware clustering (:meth:`HeadGrouping.build`, same H_p and
  scope as the profile) runs over the rank's own ``K/N`` heads of each layer (``per_layer``) or
  its ``L*K/N`` heads (``global``). A group never spans ranks, and every rank has the same
  number ``G`` of groups and the same group sizes.
* **Shared group budgets.** Group ``g`` keeps, on every rank, the ratio
  ``s_g = max over ranks of (the max ratio of rank r's group g)``. Groups are numbered by
  descending ratio inside each rank, so the pairing puts like with like and ``sum_g s_g`` stays
  close to each rank's own sum (:attr:`TensorParallelLayout.budget_overhead` says how close).
  Every rank then keeps ``k_g(n)`` tokens in group ``g`` for a segment of ``n`` tokens, so a
  request's pages per group, its footprint, the pages every step allocates and the page ids
  the allocators hand out are identical on every rank: admission, decode-memory checks,
  retraction and radix eviction decide the same everywhere without any exchange.
* **Same pool on every rank.** Equal ``G``, ``H_p`` and ``s_g`` give every rank the same bytes per
  logical token; SGLang gives every rank the same token capacity (the minimum of the ranks' free
  memory), so every rank's pool has the same number of pages.

Each member of a group keeps its own top-``k_g`` tokens (scored over the rank's own heads, as on
one GPU); a head whose own ratio is below its group's keeps more, never fewer, tokens than the
profile asks. A ratio-1.0 profile keeps everything on every rank.

:func:`rank_profile` turns all this into an ordinary :class:`BudgetProfile` for one rank (model
``K/N`` KV heads, ``Q/N`` query heads, the rank's grouping, each head's ratio lifted to ``s_g``),
so the pool, page tables, split table, scorer and kernels run per rank unchanged.

No sglang import: the integration layer reads the rank from SGLang and passes it in.

Source: docs/design.md (tensor parallelism); SGLang 0.5.17 ``layers/linear.py``
``QKVParallelLinear`` (head shards), ``mem_cache/kv_cache_configurator.py`` (capacity is the
minimum over ranks); Tangram arXiv 2606.06302 (Ragged Paging, Budget Reservation).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tangram_sglang.errors import ConfigError
from tangram_sglang.grouping import HeadGrouping
from tangram_sglang.profile import BudgetProfile, CalibrationStats, ModelIdentity

TP_FLAG = "--tp-size"
GROUP_FLAG = "--tangram-page-group-size"
SCOPE_FLAG = "--tangram-scope"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def kv_head_range(num_kv_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """KV heads ``[lo, hi)`` that TP rank ``rank`` holds of every layer (SGLang's shard).

    Args:
        num_kv_heads: the model's KV heads per layer (all ranks together).
        tp_size: tensor-parallel ranks N (``--tp-size``).
        rank: this rank, in ``[0, N)``.

    Returns:
        ``(lo, hi)``: head indices, ``hi - lo = num_kv_heads / N``.

    Raises:
        ConfigError: ``tp_size`` not dividing ``num_kv_heads`` or ``rank`` outside
            ``[0, tp_size)``.
    """
    if tp_size < 1 or num_kv_heads % tp_size:
        raise ConfigError(
            f"{TP_FLAG} {tp_size} does not divide the model's {num_kv_heads} KV heads; use one "
            f"of {_divisors(num_kv_heads)}"
        )
    if not 0 <= rank < tp_size:
        raise ConfigError(f"TP rank {rank} is outside [0, {tp_size}) for {TP_FLAG} {tp_size}")
    per_rank = num_kv_heads // tp_size
    return rank * per_rank, (rank + 1) * per_rank


def check_tensor_parallel(
    model: ModelIdentity, heads_per_group: int, scope: str, tp_size: int
) -> None:
    """Start-up checks of ``--tangram --tp-size N`` (before any rank builds its pool).

    Args:
        model: the served model (whole model, not one rank's share).
        heads_per_group: H_p of the resolved profile (``--tangram-page-group-size`` or the
            profile's).
        scope: head-group scope of the resolved profile (``per_layer`` | ``global``).
        tp_size: N, SGLang's ``--tp-size``.

    Raises:
        ConfigError: N < 1; N not dividing the KV heads (SGLang would replicate a KV head on
            several ranks, and Tangram's pools would hold different copies) or the query heads;
            ``per_layer`` groups of H_p heads that would span ranks (H_p > K/N) or that do not
            tile a rank's K/N heads (H_p not dividing K/N); ``global`` groups larger than a
            rank's ``L*K/N`` heads. Each message gives the values that work.
    """
    n = int(tp_size)
    k, q, layers = model.num_kv_heads, model.num_qo_heads, model.num_layers
    if n < 1:
        raise ConfigError(f"{TP_FLAG} {tp_size} must be >= 1")
    good_tp = [d for d in _divisors(k) if q % d == 0]
    if k % n or q % n:
        raise ConfigError(
            f"{TP_FLAG} {n} cannot be combined with --tangram for {model.architecture}: it does "
            f"not divide the model's {k} KV heads and {q} query heads (each TP rank must hold "
            f"whole KV heads; SGLang would replicate them). Use {TP_FLAG} in {good_tp}."
        )
    per_rank = k // n
    if scope == "per_layer":
        fits = _divisors(per_rank)
        if heads_per_group > per_rank:
            raise ConfigError(
                f"{GROUP_FLAG} {heads_per_group} with {TP_FLAG} {n}: a head group of "
                f"{heads_per_group} KV heads would span TP ranks (each rank holds {per_rank} of "
                f"the {k} KV heads of a layer, and head groups never cross ranks). Use "
                f"{GROUP_FLAG} in {fits}, {SCOPE_FLAG} global, or a smaller {TP_FLAG}."
            )
        if per_rank % heads_per_group:
            raise ConfigError(
                f"{GROUP_FLAG} {heads_per_group} does not divide the {per_rank} KV heads each "
                f"TP rank holds per layer ({TP_FLAG} {n}, {k} KV heads), which scope "
                f"'per_layer' needs. Use {GROUP_FLAG} in {fits} or {SCOPE_FLAG} global."
            )
    elif heads_per_group > layers * per_rank:
        raise ConfigError(
            f"{GROUP_FLAG} {heads_per_group} with {TP_FLAG} {n}: a head group would span TP "
            f"ranks (each rank holds {layers * per_rank} KV heads over all layers). Use "
            f"{GROUP_FLAG} <= {layers * per_rank}."
        )


@dataclass(frozen=True, slots=True)
class TensorParallelLayout:
    """Every TP rank's head groups and the group budgets all ranks share.

    Build with :meth:`build`. Rank ``r`` holds KV heads ``[r*K/N, (r+1)*K/N)`` of every layer;
    its groups are numbered ``0..G-1`` locally (the same G on every rank).

    Attributes:
        tp_size: N.
        num_kv_heads: K, the whole model's KV heads per layer.
        groupings: N groupings, rank r's over its local heads: ``cluster_of`` / ``column_of``
            int64 ``[num_layers, K/N]`` (local head ``h`` is model head ``r*K/N + h``).
        own_group_ratios: float64 ``[N, G]``: each rank's group ratios from its own heads (the
            max member ratio, as on one GPU).
        shared_group_ratios: float64 ``[G]``: ``own_group_ratios.max(axis=0)``, the ratio group
            ``g`` keeps on every rank.
    """

    tp_size: int
    num_kv_heads: int
    groupings: tuple[HeadGrouping, ...]
    own_group_ratios: np.ndarray
    shared_group_ratios: np.ndarray

    @classmethod
    def build(cls, profile: BudgetProfile, tp_size: int) -> TensorParallelLayout:
        """Group each rank's heads (budget-aware clustering) and share the group budgets.

        Runs at start-up (every process computes the same layout from the same profile).

        Args:
            profile: the resolved profile of the whole model (rescaled/regrouped by the flags);
                its H_p and scope are kept.
            tp_size: N.

        Raises:
            ConfigError: :func:`check_tensor_parallel`.
        """
        g = profile.grouping
        check_tensor_parallel(profile.model, g.heads_per_group, g.scope, tp_size)
        k = profile.model.num_kv_heads
        groupings, own = [], []
        for rank in range(int(tp_size)):
            lo, hi = kv_head_range(k, tp_size, rank)
            local = HeadGrouping.build(profile.ratio[:, lo:hi], g.heads_per_group, g.scope)
            groupings.append(local)
            own.append(local.group_ratios(profile.ratio[:, lo:hi]))
        own_ratios = np.stack(own)  # equal G on every rank: same head count, H_p, scope
        return cls(int(tp_size), k, tuple(groupings), own_ratios, own_ratios.max(axis=0))

    # ---- derived numbers ---------------------------------------------------------------------
    @property
    def heads_per_rank(self) -> int:
        """KV heads per layer on each rank (K/N)."""
        return self.num_kv_heads // self.tp_size

    @property
    def num_head_groups(self) -> int:
        """G, head groups per rank (the same on every rank)."""
        return int(self.shared_group_ratios.size)

    @property
    def budget_overhead(self) -> float:
        """Extra kept tokens from sharing budgets: ``sum_g s_g / max_r sum_g own[r, g] - 1``.

        0 when every rank's groups have the same ratios (a uniform profile); the price paid for
        every rank deciding alike (a fraction of the largest rank's own kept tokens, long
        segments).
        """
        return float(self.shared_group_ratios.sum() / self.own_group_ratios.sum(axis=1).max() - 1)

    def model_cluster_of(self) -> np.ndarray:
        """int64 ``[num_layers, K]``: every model head's group as ``rank * G + local group``.

        A model-wide view for checks and reports: group ``i`` lives on rank ``i // G``.
        """
        return np.concatenate(
            [grp.cluster_of + r * self.num_head_groups for r, grp in enumerate(self.groupings)],
            axis=1,
        )

    def rank_of_group(self) -> np.ndarray:
        """int64 ``[N * G]``: the rank holding each group of :meth:`model_cluster_of`."""
        return np.repeat(np.arange(self.tp_size), self.num_head_groups)

    def rank_profile(self, profile: BudgetProfile, rank: int) -> BudgetProfile:
        """The profile rank ``rank`` serves with: its heads, its groups, the shared budgets.

        Model: ``K/N`` KV heads, ``Q/N`` query heads (the rest as ``profile.model``). Ratio of
        local head ``h`` in layer ``l``: ``shared_group_ratios[cluster_of[l, h]]``, so the
        profile's group ratios (and :func:`~tangram_sglang.profile.kept_len` per group, the one
        footprint formula) are the shared ones. Calibration stats are the rank's slice, and so are
        a ``kvzip-gate`` profile's per-KV-head gate weights (``scorer_options.weights``);
        ``provenance["tensor_parallel"]`` records the shard.

        Args:
            profile: the profile :meth:`build` was given.
            rank: TP rank in ``[0, N)`` (SGLang's attention TP rank).

        Raises:
            ConfigError: ``rank`` out of range.
        """
        m = profile.model
        lo, hi = kv_head_range(m.num_kv_heads, self.tp_size, rank)
        grouping = self.groupings[rank]
        stats = profile.stats
        if stats is not None:
            stats = CalibrationStats(
                stats.mean[:, lo:hi].copy(),
                stats.std[:, lo:hi].copy(),
                stats.alpha,
                stats.num_samples,
            )
        model = ModelIdentity(
            architecture=m.architecture,
            num_layers=m.num_layers,
            num_kv_heads=self.heads_per_rank,
            num_qo_heads=m.num_qo_heads // self.tp_size,
            head_dim=m.head_dim,
            config_fingerprint=m.config_fingerprint,
        )
        shard = {
            "tp_size": self.tp_size,
            "tp_rank": int(rank),
            "kv_heads": [lo, hi],
            "budget_overhead": round(self.budget_overhead, 6),
        }
        provenance = {**profile.provenance, "tensor_parallel": shard}
        options = provenance.get("scorer_options") or {}
        if options.get("weights") is not None:  # kvzip-gate: a gate per KV head, this rank's
            provenance["scorer_options"] = {
                **options,
                "weights": [layer[lo:hi] for layer in options["weights"]],
            }
        return BudgetProfile(
            model=model,
            scorer=profile.scorer,
            target_ratio=profile.target_ratio,
            ratio=self.shared_group_ratios[grouping.cluster_of].astype(np.float64),
            sink_tokens=profile.sink_tokens,
            recent_window=profile.recent_window,
            grouping=grouping,
            stats=stats,
            provenance=provenance,
            min_compress_tokens=profile.min_compress_tokens,
        )

    def padded_kept_fraction(self) -> float:
        """Fraction of a rank's full KV that its pages hold for long segments (every rank).

        ``sum_g(s_g * H_p) / (L * K/N)``: the single-GPU formula
        (``profile_loader.padded_kept_fraction``) over one rank's heads with the shared budgets.
        """
        grouping = self.groupings[0]
        heads = grouping.num_layers * self.heads_per_rank
        return float(self.shared_group_ratios.sum() * grouping.heads_per_group / heads)

    def summary(self) -> dict[str, object]:
        """Plain-builtin numbers for the start-up log and ``/server_info``.

        ``padded_kept_ratio`` and ``predicted_capacity_vs_full_kv`` are per rank (they replace
        the whole-model numbers of a single-GPU summary: each rank's pool is sized by them).
        """
        padded = self.padded_kept_fraction()
        return {
            "tp_size": self.tp_size,
            "kv_heads_per_rank": self.heads_per_rank,
            "head_groups_per_rank": self.num_head_groups,
            "tp_budget_overhead": round(self.budget_overhead, 6),
            "padded_kept_ratio": round(padded, 6),
            "predicted_capacity_vs_full_kv": round(1.0 / padded, 4),
        }


def rank_profile(profile: BudgetProfile, tp_size: int, rank: int) -> BudgetProfile:
    """:meth:`TensorParallelLayout.rank_profile` of a fresh layout; ``tp_size == 1`` -> ``profile``.

    Raises:
        ConfigError: as :meth:`TensorParallelLayout.build` and ``rank`` out of range.
    """
    if int(tp_size) == 1:
        kv_head_range(profile.model.num_kv_heads, 1, rank)  # rank must be 0
        return profile
    return TensorParallelLayout.build(profile, tp_size).rank_profile(profile, rank)
