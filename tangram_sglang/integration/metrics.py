"""Tangram pool numbers in SGLang's per-step log lines and on ``/metrics`` (Prometheus gauges).

Owns the operator's view of the page pool while the server runs (issue 6, "Observability"):

* every prefill/decode log line of the scheduler gets a ``tangram pages: ...`` part (pages used
  of the pool, pages reserved by running requests, KV bytes held vs what full KV would hold for
  the same live tokens, fragmentation);
* with ``--enable-metrics``, ``/metrics`` carries the gauges of :data:`GAUGES`.

The hook chain follows SGLang 0.5.17's own path from pool to log line and gauge:
``SchedulerPoolStatsObserver.get_pool_stats`` (we tag the ``PoolStats`` with the scheduler's
``TangramState``) -> ``PoolStats.get_{prefill,decode}_usage_msg_parts`` (log parts) and
``PoolStats.update_scheduler_stats`` (copies a :class:`PoolSnapshot` onto ``SchedulerStats``) ->
``SchedulerMetricsCollector.log_stats`` (sets the gauges). The snapshot is taken only where a
log line or the metrics need it, never per forward; its only O(num_pages) part (fragmentation)
is refreshed at most every :data:`FRAGMENTATION_MAX_AGE_S` seconds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

STATE_ATTR = "tangram_state"  # attribute we put on SGLang's PoolStats
SNAPSHOT_ATTR = "tangram"  # attribute we put on SGLang's SchedulerStats
MIB = 1 << 20
FRAGMENTATION_MAX_AGE_S = 5.0  # seconds a log line / gauge may reuse a fragmentation value

# gauge name -> (PoolSnapshot field, documentation)
GAUGES: dict[str, tuple[str, str]] = {
    "tangram:pages_total": ("pages_total", "Pages the Tangram pool can hand out."),
    "tangram:pages_used": ("pages_used", "Pages held by requests or radix nodes."),
    "tangram:pages_reserved": (
        "pages_reserved",
        "Pages granted to running requests by Budget Reservation and not allocated yet.",
    ),
    "tangram:pages_free": ("pages_free", "Pages with no holder."),
    "tangram:kv_bytes_held": ("bytes_held", "KV bytes held in Tangram pages (K and V)."),
    "tangram:full_kv_bytes": (
        "full_kv_bytes",
        "KV bytes stock SGLang would hold for the same live tokens (uncompressed).",
    ),
    "tangram:kv_bytes_saved": (
        "bytes_saved",
        "full_kv_bytes - kv_bytes_held (negative when short segments pad past full KV).",
    ),
    "tangram:radix_pages_held": (
        "radix_pages_held",
        "Pages the radix tree holds (compressed history and shared prefixes), each shared page "
        "once; included in pages_used.",
    ),
    "tangram:fragmentation": (
        "fragmentation",
        "Share of the (token, KV head) slots of held pages that hold no token "
        f"(up to {FRAGMENTATION_MAX_AGE_S:g} s old).",
    ),
}


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """The pool at one instant, in the units the log and the gauges use.

    Attributes:
        pages_total / pages_used / pages_reserved / pages_free: pages.
        bytes_held: bytes in held pages (K and V, all layers; running requests and radix tree).
        full_kv_bytes: bytes a full-KV pool would hold for the same logical tokens (the token
            slots SGLang counts as used or evictable: running requests and radix tree).
        fragmentation: unused (token, head) slots / slots of held pages, in [0, 1]; up to
            :data:`FRAGMENTATION_MAX_AGE_S` old (0.0 at once when no page is held).
        radix_pages_held: pages the radix tree's nodes hold (a page shared by many
            conversations counts once; 0 without a tree); part of ``pages_used``.
    """

    pages_total: int
    pages_used: int
    pages_reserved: int
    pages_free: int
    bytes_held: int
    full_kv_bytes: int
    fragmentation: float
    radix_pages_held: int = 0

    @property
    def bytes_saved(self) -> int:
        """``full_kv_bytes - bytes_held`` (bytes; negative when Tangram holds more)."""
        return self.full_kv_bytes - self.bytes_held

    def log_part(self) -> str:
        """The part appended to SGLang's prefill/decode log line."""
        return (
            f"tangram pages: {self.pages_used}/{self.pages_total} "
            f"({self.pages_reserved} reserved), KV {self.bytes_held / MIB:.1f} MiB vs full KV "
            f"{self.full_kv_bytes / MIB:.1f} MiB, frag {self.fragmentation:.3f}"
        )

    def to_dict(self) -> dict[str, float]:
        """JSON-ready numbers, ``bytes_saved`` included."""
        return {**asdict(self), "bytes_saved": self.bytes_saved}


def snapshot(state: Any, held_tokens: int) -> PoolSnapshot:
    """Snapshot a ``backend.state.TangramState`` for a log line or the gauges.

    Page and byte counts are O(1) and current; the fragmentation is O(num_pages) and at most
    :data:`FRAGMENTATION_MAX_AGE_S` old (``TangramState.fragmentation``): a snapshot runs for
    every prefill batch and decode log line, while the GPU waits.

    Args:
        state: the scheduler's Tangram state.
        held_tokens: logical tokens whose KV the server holds (tokens; SGLang's used +
            evictable token slots), priced at full KV for ``full_kv_bytes``.
    """
    allocator = state.memory.allocator
    used = allocator.num_used()
    return PoolSnapshot(
        pages_total=int(allocator.num_usable_pages),
        pages_used=int(used),
        pages_reserved=int(state.memory.ledger.outstanding_pages()),
        pages_free=int(allocator.num_free()),
        bytes_held=int(used) * int(state.memory.bytes_per_page),
        full_kv_bytes=int(held_tokens) * int(state.full_kv_bytes_per_token),
        fragmentation=float(state.fragmentation(FRAGMENTATION_MAX_AGE_S)),
        radix_pages_held=int(getattr(state.radix, "held_pages", 0) or 0),
    )


def tag_pool_stats(result: Any, observer: Any) -> None:
    """AFTER ``SchedulerPoolStatsObserver.get_pool_stats``: tag the PoolStats with our state.

    Cheap (an attribute); the snapshot is taken by the hooks that format or export it.
    """
    kvcache = observer.token_to_kv_pool_allocator.get_kvcache()
    state = getattr(kvcache, "tangram_state", None)
    if state is not None:
        setattr(result, STATE_ATTR, state)


def _snapshot_of(pool_stats: Any) -> PoolSnapshot | None:
    state = getattr(pool_stats, STATE_ATTR, None)
    if state is None:
        return None
    return snapshot(state, pool_stats.full_num_used + pool_stats.full_evictable_size)


def add_usage_msg_part(result: list[str], pool_stats: Any) -> list[str] | None:
    """AFTER ``PoolStats.get_{prefill,decode}_usage_msg_parts``: append the Tangram part."""
    snap = _snapshot_of(pool_stats)
    if snap is None:
        return None
    return [*result, snap.log_part()]


def copy_to_scheduler_stats(result: Any, pool_stats: Any, stats: Any) -> None:
    """AFTER ``PoolStats.update_scheduler_stats``: put a snapshot on ``SchedulerStats``."""
    snap = _snapshot_of(pool_stats)
    if snap is not None:
        setattr(stats, SNAPSHOT_ATTR, snap)


_gauges: dict[str, Any] = {}  # per process: prometheus refuses a name registered twice


def _gauge(name: str, labelnames: list[str]) -> Any:
    if name not in _gauges:
        from prometheus_client import Gauge  # after SGLang set PROMETHEUS_MULTIPROC_DIR

        _gauges[name] = Gauge(
            name=name,
            documentation=GAUGES[name][1],
            labelnames=labelnames,
            multiprocess_mode="mostrecent",
        )
    return _gauges[name]


def export_gauges(result: Any, collector: Any, stats: Any) -> None:
    """AFTER ``SchedulerMetricsCollector.log_stats``: set the ``tangram:*`` gauges."""
    snap = getattr(stats, SNAPSHOT_ATTR, None)
    if snap is None:
        return
    values = snap.to_dict()
    for name, (field, _) in GAUGES.items():
        _gauge(name, list(collector.labels)).labels(**collector.labels).set(values[field])
