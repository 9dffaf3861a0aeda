"""Head groups: which KV heads share one ragged page table (Tangram's Ragged Paging).

Budget-aware clustering (Tangram arXiv 2606.06302, "Ragged Paging"): sort the KV heads by their
static ratio and cut the sorted list into chunks of ``heads_per_group`` (H_p). A group's ratio is
the largest ratio among its members, so every member keeps the same number of tokens (its OWN
top-k tokens) and the group shares one page list and one kept length.

Scopes:
  ``per_layer``  groups never span layers; H_p must divide H_kv; ``group_id = layer * G_l + g``.
  ``global``     all ``L * H_kv`` heads are sorted together, so a group may span layers (far less
                 padding waste). The last group may be partial when H_p does not divide L * H_kv;
                 its unused columns are counted as fragmentation.

Columns inside a group are ordered by (layer, head), so ``column_of`` is deterministic.

This module owns only the map. Pages, lengths and the kernels' view of it live in ``mem/`` and
``kernels/``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tangram_sglang.errors import ProfileError

SCOPES = ("per_layer", "global")


@dataclass(frozen=True, slots=True)
class HeadGrouping:
    """The (layer, kv_head) -> (head group, column) bijection.

    Attributes:
        heads_per_group: H_p, KV heads per group (columns per page).
        scope: ``"per_layer"`` or ``"global"``.
        cluster_of: int64 array ``[num_layers, num_kv_heads]``: the head group of each KV head.
        column_of: int64 array ``[num_layers, num_kv_heads]``: the head's column in its group's
            pages, in ``[0, heads_per_group)``.
    """

    heads_per_group: int
    scope: str
    cluster_of: np.ndarray
    column_of: np.ndarray

    @property
    def num_head_groups(self) -> int:
        """Number of head groups over the whole model."""
        return int(self.cluster_of.max()) + 1

    @property
    def num_layers(self) -> int:
        return int(self.cluster_of.shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.cluster_of.shape[1])

    def members(self, group_id: int) -> list[tuple[int, int]]:
        """(layer, kv_head) pairs of one group, ordered by column."""
        layers, heads = np.nonzero(self.cluster_of == group_id)
        order = np.argsort(self.column_of[layers, heads])
        return [(int(layers[i]), int(heads[i])) for i in order]

    def group_sizes(self) -> np.ndarray:
        """int64 ``[num_head_groups]``: member heads per group (H_p except a partial last one)."""
        return np.bincount(self.cluster_of.ravel(), minlength=self.num_head_groups)

    def group_ratios(self, ratio: np.ndarray) -> np.ndarray:
        """float64 ``[num_head_groups]``: each group's ratio, the max over its member heads.

        Args:
            ratio: float array ``[num_layers, num_kv_heads]`` of per-head ratios in (0, 1].
        """
        out = np.zeros(self.num_head_groups, dtype=np.float64)
        np.maximum.at(out, self.cluster_of.ravel(), np.asarray(ratio, np.float64).ravel())
        return out

    def validate(self, num_layers: int, num_kv_heads: int) -> None:
        """Check shapes and that the map is a bijection onto (group, column) slots.

        Raises:
            ProfileError: naming the field (``grouping.cluster_of`` ...) and the fix.
        """
        shape = (num_layers, num_kv_heads)
        if self.scope not in SCOPES:
            raise ProfileError(f"grouping.scope={self.scope!r} is unknown; use one of {SCOPES}")
        if self.heads_per_group < 1:
            raise ProfileError(f"grouping.page_group_size={self.heads_per_group} must be >= 1")
        if self.scope == "per_layer" and num_kv_heads % self.heads_per_group:
            raise ProfileError(
                f"grouping.page_group_size={self.heads_per_group} does not divide "
                f"num_kv_heads={num_kv_heads}, which scope 'per_layer' needs; pick a divisor of "
                f"{num_kv_heads} or use scope 'global'"
            )
        for name in ("cluster_of", "column_of"):
            arr = getattr(self, name)
            if arr.shape != shape:
                raise ProfileError(
                    f"grouping.{name} has shape {list(arr.shape)} but the model has "
                    f"[num_layers, num_kv_heads] = {list(shape)}; recalibrate for this model"
                )
        self._check_slots()
        if self.scope == "per_layer":
            groups_per_layer = num_kv_heads // self.heads_per_group
            layer_of_group = self.cluster_of // groups_per_layer
            if not (layer_of_group == np.arange(num_layers)[:, None]).all():
                raise ProfileError(
                    "grouping: scope 'per_layer' but a group spans layers; rebuild the map"
                )

    def _check_slots(self) -> None:
        """Ids in range, no empty group id, no (group, column) slot used twice."""
        if self.cluster_of.min() < 0 or self.column_of.min() < 0:
            raise ProfileError("grouping.cluster_of/column_of hold negative ids; rebuild the map")
        if self.column_of.max() >= self.heads_per_group:
            raise ProfileError(
                f"grouping.column_of holds column {int(self.column_of.max())} >= "
                f"page_group_size={self.heads_per_group}; rebuild the map"
            )
        missing = np.setdiff1d(np.arange(self.num_head_groups), self.cluster_of)
        if missing.size:
            raise ProfileError(
                f"grouping.cluster_of skips group ids {missing[:8].tolist()}: ids must be "
                "0..num_head_groups-1 with no empty group (an empty group would still reserve "
                "pages); rebuild the map with HeadGrouping.build"
            )
        slots = self.cluster_of.astype(np.int64) * self.heads_per_group + self.column_of
        if np.unique(slots).size != slots.size:
            raise ProfileError(
                "grouping: two heads share one (cluster, column) slot; rebuild the map with "
                "HeadGrouping.build"
            )

    @classmethod
    def build(cls, ratio: np.ndarray, heads_per_group: int, scope: str) -> HeadGrouping:
        """Budget-aware clustering: sort heads by ratio (descending), chunk into groups of H_p.

        Runs at calibration time or at server start-up, never per step.

        Args:
            ratio: float array ``[num_layers, num_kv_heads]``, per-head ratios in (0, 1].
            heads_per_group: H_p (KV heads per group).
            scope: ``"per_layer"`` or ``"global"``.

        Returns:
            The grouping; ties in ratio are broken by (layer, head) so the map is deterministic.

        Raises:
            ProfileError: unknown scope, H_p < 1, or H_p not dividing H_kv for ``per_layer``.

        Source: Tangram arXiv 2606.06302, Ragged Paging (budget-aware clustering).
        """
        ratio = np.asarray(ratio, dtype=np.float64)
        num_layers, num_kv_heads = ratio.shape
        cluster_of = np.zeros(ratio.shape, dtype=np.int64)
        column_of = np.zeros(ratio.shape, dtype=np.int64)
        probe = cls(heads_per_group, scope, cluster_of, column_of)
        if (
            scope not in SCOPES
            or heads_per_group < 1
            or (scope == "per_layer" and num_kv_heads % heads_per_group)
        ):
            probe.validate(num_layers, num_kv_heads)  # raises the precise message
        if scope == "global":
            _chunk(ratio.ravel(), heads_per_group, 0, cluster_of.ravel(), column_of.ravel())
        else:
            groups_per_layer = num_kv_heads // heads_per_group
            for layer in range(num_layers):
                _chunk(
                    ratio[layer],
                    heads_per_group,
                    layer * groups_per_layer,
                    cluster_of[layer],
                    column_of[layer],
                )
        grouping = cls(heads_per_group, scope, cluster_of, column_of)
        grouping.validate(num_layers, num_kv_heads)
        return grouping


def _chunk(
    ratio: np.ndarray,
    heads_per_group: int,
    first_group: int,
    cluster: np.ndarray,
    column: np.ndarray,
) -> None:
    """Sort a flat list of heads by ratio (desc, stable) and assign groups/columns in place."""
    order = np.argsort(-ratio, kind="stable")
    for rank, start in enumerate(range(0, order.size, heads_per_group)):
        members = np.sort(order[start : start + heads_per_group])  # columns by (layer, head)
        cluster[members] = first_group + rank
        column[members] = np.arange(members.size)
