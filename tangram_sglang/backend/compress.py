"""Which new tokens each KV head keeps: the scorer + top-``k_g`` step of a prefill/extend segment.

Runs per layer inside ``TangramAttnBackend.forward_extend``, after the extend attention (whose
``lse`` normalises the observation-window scores over history + segment) and before the kept-KV
write. Torch ops (and, opt-in, one Triton kernel per padded bucket for SnapKV-family scorers
and kvzip-lite: ``kernels.window_scores``); no sglang import: the backend hands plain tensors
in and writes the result with the kv-write kernel. Per request and KV head h of the layer the
head keeps ``k_g = kept_len(n, group_ratio[g])`` tokens (g = its head group), its OWN top
``k_g`` by score.

Cost (per layer): segments (SnapKV family and kvzip-lite) are scored in length buckets (next
power of two of n, at least :data:`MIN_BUCKET` tokens), each bucket as ONE padded batch whatever
its segments' lengths, and smaller buckets merge into the longest while the padded batch stays
under :data:`MAX_PADDED_TOKENS` (:func:`_merge_buckets`): the selection is host-bound (about 30
small launches per padded batch, each 30-45 us of host time on an H200 host, benchmarks/RESULTS.md),
so an extend batch of mixed lengths costs the launches of one padded batch, not of one per
bucket or per run of equal lengths (4,098 top-level aten ops per layer for 64 distinct
ShareGPT-like lengths before the buckets; kvzip-lite 2,526 for 16). A batch with no more runs
of equal lengths than padded batches (one prefill chunk, or many segments of one length) skips
the padding: one scorer call per run. Other scorers run per run of equal lengths. A token
scorer (``kvzip-gate``, ``scoring.kvzip_gate``) scores the whole batch's new tokens in one call
from their keys and values, then takes the SnapKV family's buckets or runs with no queries.
Every head is selected with one stable sort whatever its ``k_g``, with no host
synchronisation. A scorer with a ``window_share`` (kvzip-lite, kvzip-gate; off by default)
has its scores fused with the observation window's SnapKV scores before the sort, on every
path (``scoring.select.window_union``, as its HF side does): a run by the scorer's own
``score`` (kvzip-lite) or a second SnapKV call on the run (the gate), a bucket by the window's
slots of the same rows (kvzip-lite's ``_Bucket.window_bucket``; a gate's bucket is a SnapKV
bucket of the window); under ``TANGRAM_SCORE_KERNEL`` kvzip-lite's window runs in the SnapKV
window kernel beside its query-max kernel, while the gate, which takes no kernel path, scores
its window with torch ops. Segments every head keeps whole (``k_g = n``, e.g. under
``--tangram-min-compress-tokens``) are not scored.

Padded layout of a bucket of ``b`` segments, ``N`` = the bucket length, ``W`` = the widest
observation window in it (``w_i = min(obs_window, n_i)``)::

    position p in [0, N):   [ pad .......... | token 0 ... token n_i - 1 ]    (right-aligned)
                                off_i = N - n_i
    query slot j in [0, W): valid for j >= W - w_i, at position N - W + j

Right alignment puts every segment's observation window at the end of the bucket, so one
product serves the bucket (a causal mask is not needed: it would only hide window keys, which
are not scored, from earlier window queries). Pad keys get probability 0 before the mean and
the pooling (the zero padding of the per-segment path), the window tokens ``[N - w_i, N)``
score above every context token, the sinks sit at ``off_i`` (per segment), pad positions rank
last (-inf), and the kept positions are shifted back by ``off_i``. The result equals
:func:`reference_kept_indices` up to ties flipped by floating-point summation order (a padded
product sums in another order than a per-segment one).

Source: Tangram arXiv 2606.06302 (Budget Reservation: prefill keeps only the kept K/V);
docs/contracts.md (scorer interface, kept-KV write); SnapKV (arXiv 2404.14469) §4.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from tangram_sglang.errors import KernelError
from tangram_sglang.host_copy import host_to_device
from tangram_sglang.kernels.window_scores import query_max_scores, window_scores
from tangram_sglang.kernels.window_scores import supported as window_scores_supported
from tangram_sglang.scoring.base import Scorer
from tangram_sglang.scoring.kvzip_gate import is_token_scorer
from tangram_sglang.scoring.kvzip_lite import KVzipLiteScorer, slot_table
from tangram_sglang.scoring.select import (
    priority_key,
    protected_mask,
    select_kept,
    window_union,
)
from tangram_sglang.scoring.snapkv import WINDOW_SCORER, SnapKVScorer, reduce_gqa, window_share_of

logger = logging.getLogger(__name__)
# score buckets with kernels.window_scores (SnapKV family, kvzip-lite); server env. Off: the
# kvzip-lite query-max kernel ran 5-13x slower than the torch path on the H200 (RESULTS.md)
SCORE_KERNEL = os.environ.get("TANGRAM_SCORE_KERNEL") == "1"
MIN_BUCKET = 64  # tokens: the shortest bucket (shorter segments share it)
# tokens: the most a merged padded batch holds (b * N). The torch path's peak for it is about
# three times its window logits (b * N * Hq * W float32: 256 MiB for Llama-3.1-8B's 32 query
# heads and a 32-token window), i.e. ~768 MiB with the float32 copy of the keys and the
# product's contiguous copy: what a single 64 x 1,024 bucket of equal lengths already took.
MAX_PADDED_TOKENS = 65_536
MAX_MERGE_SPREAD = 8  # a bucket merges into one at most this many times longer
# float32 elements of one kvzip-lite logits block of a padded bucket ([b, H_q, m, N], 512 MiB):
# the query slots are scored in blocks of m = this / (b * H_q * N) (the per-segment scorer's
# temporary on a 16k-token chunk is the same size: H_q * query_block * n); with the keys'
# float32 copy ([b, H_kv, D + 1, N]) and the block's max, the path's peak stays under ~0.8 GiB
# at MAX_PADDED_TOKENS on Llama-3.1-8B's shapes
MAX_QUERY_BLOCK_FLOATS = 1 << 27
_PLAN_CACHE_SIZE = 16  # batch plans kept (per batch shape and scored rows; whole fills apart)


def kept_from_ranks(
    key: torch.Tensor, kept: torch.Tensor, max_k: int, offset: torch.Tensor | None = None
) -> torch.Tensor:
    """Each row's top ``kept[row]`` entries of ``key``, as ascending indices, 0-padded.

    Equal to ``select_kept`` row by row (stable descending sort: ties go to lower indices), but
    one sort for every row whatever its count, and no host synchronisation: the first
    ``max_k`` entries of the descending order, those past the row's count replaced by ``n``
    (which sorts last), sorted ascending, ``n`` then replaced by 0. Seven top-level ops that do
    work (eight with ``offset``; a sort may launch several kernels) whatever the rows' counts:
    the selection is host-bound (benchmarks/RESULTS.md, issue 18). Requires ``max_k <= n``.

    Args:
        key: float32 ``[..., n]`` priority keys (``scoring.select.priority_key``).
        kept: int64 ``[...]`` tokens to keep per row (``1 <= kept <= n``), same device.
        max_k: host int, ``kept.max() <= max_k <= n`` (the output width).
        offset: optional int64, broadcastable to ``[..., 1]``: subtracted from every kept
            index (a padded bucket's first real position, ``off_i``); the padding stays 0.

    Returns:
        int64 ``[..., max_k]``: row r's kept indices (minus ``offset``) ascending in its first
        ``kept[r]`` entries, 0 after.
    """
    n = key.shape[-1]
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :max_k]
    cols = torch.arange(max_k, device=key.device)
    top = torch.where(cols < kept.unsqueeze(-1), order, n)  # past the row's count: n, last
    top = torch.sort(top, dim=-1).values
    pad = top == n
    if offset is not None:
        top = top - offset
    return top.masked_fill_(pad, 0)


def _score_run(
    scorer: Scorer,
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    start: int,
    m: int,
    n: int,
    sm_scale: float,
) -> torch.Tensor:
    """float32 ``[m, H_kv, n]`` scores of ``m`` consecutive requests of ``n`` new tokens each."""
    w = min(scorer.obs_window, n)
    end = start + m * n
    q_run = q[start:end].view(m, n, q.shape[1], q.shape[2])
    k_run = k[start:end].view(m, n, k.shape[1], k.shape[2])
    lse_run = lse[start:end].view(m, n, lse.shape[1])
    return scorer.score(
        q_run[:, n - w :].transpose(1, 2),
        k_run.transpose(1, 2),
        sm_scale,
        lse_obs=lse_run[:, n - w :].transpose(1, 2),
    )


def batch_kept_indices(
    scorer: Scorer,
    q: torch.Tensor,
    k_new: torch.Tensor,
    lse: torch.Tensor,
    bounds: list[int],
    kept_per_head: Sequence[Sequence[int]] | np.ndarray,
    sm_scale: float,
    sink_tokens: int,
    recent_window: int,
    kept_per_head_dev: torch.Tensor | None = None,
    window_kernel: bool | None = None,
    v_new: torch.Tensor | None = None,
    layer_id: int | None = None,
    token_scores: torch.Tensor | None = None,
) -> torch.Tensor:
    """Kept token indices of every request of an extend batch, per KV head (per layer).

    Args:
        scorer: the profile's scorer (its ``obs_window`` = w; a token scorer with a
            ``window_share`` reads ``WINDOW_SCORER``'s window instead).
        q: ``[num_tokens, num_qo_heads, D]`` new tokens' queries (post-RoPE).
        k_new: ``[num_tokens, H_kv, D]`` new tokens' keys (post-RoPE, transient).
        lse: float32 ``[num_tokens, num_qo_heads]`` extend-attention normaliser (history + new).
        bounds: host copy of ``qo_indptr`` (``bs + 1`` ints, tokens).
        kept_per_head: host ``[bs, H_kv]`` ints: ``k_g`` of each request's KV heads (tokens,
            ``1 <= k <= n`` for a non-empty segment).
        sm_scale: softmax scale of the layer.
        sink_tokens, recent_window: the profile's always-kept tokens.
        kept_per_head_dev: the same counts as int64 on ``q``'s device (the backend builds it
            once per batch); None = copied here (one host-to-device copy).
        window_kernel: score with the Triton kernels of ``kernels.window_scores`` and put every
            scored segment in a padded bucket: SnapKV-family scorers' window mean (one launch in
            place of about 20) and kvzip-lite's query max (one launch per padded batch in place
            of about 12 torch ops per block of query slots). None = :data:`SCORE_KERNEL` (off unless
            ``TANGRAM_SCORE_KERNEL=1``: on the H200 the kvzip-lite kernel kept the reference's
            tokens but ran 5-13x slower than the torch path; the SnapKV-family kernel is
            untimed since its plan-cache fix, benchmarks/RESULTS.md 2026-12-02).
        v_new: ``[num_tokens, H_kv, D]`` new tokens' values; with ``layer_id``, required by a
            token scorer (``kvzip-gate``: one ``token_scores`` call over the whole batch, then
            the same buckets or runs as the SnapKV family, without queries).
        layer_id: the layer's index (a token scorer's weights are per layer).
        token_scores: float32 ``[H_kv, num_tokens]`` scores of every new token computed
            before the call (``kvzip``: from the replay pass, ``scoring.kvzip``); taken as a
            token scorer's batch scores, so ``q`` and ``lse`` are not read. Columns of segments
            kept whole are not read.

    Returns:
        int64 ``[bs, H_kv, max_k]`` (``kept_idx`` of the kv-write kernel): head h of request i
        keeps tokens ``out[i, h, :k]`` (ascending, indices into the request's new tokens), 0
        after. Identical to ``select_kept`` on each request's scores. When every request is
        kept whole it is a broadcast view of a cached tensor (no launch): read it, do not
        write into it.

    Raises:
        KernelError: a count outside ``[1, n]`` for a non-empty segment (host check), or a
            token scorer without ``v_new`` and ``layer_id``.

    Source: docs/contracts.md (``Scorer.score``, ``select_kept``).
    """
    token = token_scores is not None or is_token_scorer(scorer)
    if token_scores is None and token and (v_new is None or layer_id is None):
        raise KernelError(
            f"batch_kept_indices: scorer {scorer.name!r} scores tokens from k and v per layer; "
            "pass v_new and layer_id"
        )
    kept_host = np.asarray(kept_per_head, np.int64).reshape(len(bounds) - 1, k_new.shape[1])
    bs, num_kv_heads = kept_host.shape
    max_k = int(kept_host.max()) if kept_host.size else 1
    device = k_new.device
    if kept_per_head_dev is None:
        kept_per_head_dev = host_to_device(kept_host, device)
    lengths = np.diff(np.asarray(bounds, np.int64))
    nonempty = lengths > 0
    low, high = kept_host.min(axis=1), kept_host.max(axis=1)
    bad = nonempty & ((low < 1) | (high > lengths))
    if bad.any():  # host check: select_kept's contract, no sync
        i = int(np.nonzero(bad)[0][0])
        raise KernelError(
            f"batch_kept_indices: kept_per_head of request {i} must lie in [1, n={lengths[i]}] "
            f"(no head keeps 0 tokens), got {low[i]}..{high[i]}"
        )
    whole = nonempty & (low == lengths)  # every head keeps the whole segment: no scoring
    scored = nonempty & ~whole
    share = window_share_of(scorer)  # the window_share option (0: off, the paths as before)
    # a token scorer with a share reads the observation window's queries from its buckets
    obs_window = WINDOW_SCORER.obs_window if token and share else scorer.obs_window
    windows = (obs_window, sink_tokens, recent_window)
    snapkv = isinstance(scorer, SnapKVScorer)
    if window_kernel is None:
        window_kernel = SCORE_KERNEL
    if window_kernel and not window_scores_supported(q, k_new):
        _warn_unsupported(q, k_new)
        window_kernel = False
    kvzip = type(scorer) is KVzipLiteScorer
    window_kernel = window_kernel and (snapkv or kvzip)
    out_width = max(max_k, 1)
    plan = _batch_plan(
        bounds,
        whole,
        scored,
        snapkv or token,
        windows,
        out_width,
        device,
        window_kernel,
        scorer if kvzip else None,
        bool(share),
    )
    if not scored.any():  # nothing to score: every segment empty or kept whole by every head
        if plan.whole_fill is None:  # no new tokens at all (an empty batch)
            return torch.zeros(bs, num_kv_heads, out_width, dtype=torch.int64, device=device)
        if whole.all():  # ratio 1.0, short turns: a view of the cached fill
            return plan.whole_fill.expand(bs, num_kv_heads, out_width)
    tok = token_scores  # a token scorer's [H_kv, num_tokens] scores of the whole batch
    if tok is None and token and (plan.runs or plan.buckets):
        tok = _token_scores(scorer, k_new, v_new, layer_id)
    if plan.whole_rows is None and plan.runs == [(0, bs)]:  # one run of every request
        windows = (sink_tokens, recent_window)
        key = _run_key(scorer, q, k_new, lse, bounds, 0, bs, sm_scale, windows, tok, share)
        return kept_from_ranks(key, kept_per_head_dev, out_width)
    if plan.in_order:  # one bucket of every request, in order: its indices are the result
        bucket = plan.buckets[0]
        key = _bucket_key_of(scorer, q, k_new, lse, bucket, sm_scale, window_kernel, tok, share)
        return kept_from_ranks(key, kept_per_head_dev, out_width, bucket.offset.view(-1, 1, 1))
    out = torch.zeros(bs, num_kv_heads, out_width, dtype=torch.int64, device=device)
    if plan.whole_rows is not None:
        out[plan.whole_rows] = plan.whole_fill
    if plan.runs:  # one scorer call per run of equal lengths
        _score_runs(
            out,
            scorer,
            q,
            k_new,
            lse,
            bounds,
            kept_host,
            kept_per_head_dev,
            plan.runs,
            sm_scale,
            sink_tokens,
            recent_window,
            tok,
            share,
        )
    for bucket in plan.buckets:
        kept_dev = kept_per_head_dev.index_select(0, bucket.rows)
        key = _bucket_key_of(scorer, q, k_new, lse, bucket, sm_scale, window_kernel, tok, share)
        width = int(kept_host[bucket.rows_host].max())
        idx = kept_from_ranks(key, kept_dev, width, bucket.offset.view(-1, 1, 1))
        out[bucket.rows, :, :width] = idx
    return out


def _token_scores(
    scorer: Scorer, k_new: torch.Tensor, v_new: torch.Tensor, layer_id: int
) -> torch.Tensor:
    """A token scorer's float32 ``[H_kv, num_tokens]`` scores of the batch's new tokens."""
    return scorer.token_scores(layer_id, k_new.transpose(0, 1), v_new.transpose(0, 1))


def _bucket_key_of(
    scorer: Scorer,
    q: torch.Tensor,
    k_new: torch.Tensor,
    lse: torch.Tensor,
    bucket: _Bucket,
    sm_scale: float,
    window_kernel: bool,
    tok: torch.Tensor | None = None,
    share: float = 0.0,
) -> torch.Tensor:
    """float32 ``[b, H_kv, N]`` priority keys of one bucket (sinks and the recent window at +inf,
    NaN below every score, pads at -inf), from the scores of the scorer's kind: a token
    scorer's batch scores ``tok`` (``[H_kv, num_tokens]``) gathered into the bucket, kvzip-lite
    (query slots) or the SnapKV family (observation window).

    With a ``window_share`` (``share`` > 0, kvzip-lite or a token scorer), those scores are
    fused with :data:`~tangram_sglang.scoring.snapkv.WINDOW_SCORER`'s on the same rows
    (``scoring.select.window_union``, pads left out of the ranks) before the fixed keys: a
    token scorer's bucket carries the window's query slots itself, a kvzip-lite bucket in its
    ``window_bucket`` (the same rows in the same order)."""
    if tok is not None:
        scores = _token_bucket_scores(tok, bucket)
    elif bucket.query_pos is not None:
        scores = _query_bucket_scores(scorer, q, k_new, lse, bucket, sm_scale, window_kernel)
    else:
        scores = _window_bucket_scores(scorer, q, k_new, lse, bucket, sm_scale, window_kernel)
    if share:
        window_bucket = bucket if tok is not None else bucket.window_bucket
        window = _window_bucket_scores(
            WINDOW_SCORER, q, k_new, lse, window_bucket, sm_scale, window_kernel
        )
        fused = window_union(scores, window, share, bucket.key_valid.unsqueeze(1))
        return torch.where(bucket.fixed, bucket.fixed_key, fused)
    # NaN ranks below every score but above pad (-inf), so a pad is never kept instead.
    key = torch.nan_to_num(scores, nan=-torch.finfo(torch.float32).max)
    return torch.where(bucket.fixed, bucket.fixed_key, key)


_warned: set[tuple] = set()


def _warn_unsupported(q: torch.Tensor, k: torch.Tensor) -> None:
    """Log once per shape that the scoring kernels were asked for but cannot run here."""
    key = (q.device.type, q.shape[-1], q.shape[1], k.shape[1])
    if key not in _warned:
        _warned.add(key)
        logger.warning(
            "Tangram: TANGRAM_SCORE_KERNEL asks for the scoring kernels, but they need CUDA (or "
            "TRITON_INTERPRET=1), a power-of-two head_dim >= 16 and H_q a multiple of H_kv "
            "(device %s, head_dim %d, H_q %d, H_kv %d): scoring with torch ops",
            *key,
        )


@dataclass(frozen=True, slots=True)
class _Bucket:
    """Device index tensors of one length bucket (built once per batch shape, cached)."""

    rows: torch.Tensor  # int64 [b]: requests of the batch in this bucket
    rows_host: np.ndarray  # int64 [b]: the same on the host
    length: int  # N: padded segment length (tokens)
    window: int  # W: widest observation window of the bucket (queries)
    tokens: torch.Tensor  # int64 [b, N]: batch token index of each position (0 on pad)
    queries: torch.Tensor  # int64 [b, W]: batch token index of each query slot (0 if unused)
    offset: torch.Tensor  # int64 [b]: off_i = N - n_i, first real position
    key_valid: torch.Tensor  # bool [b, N]: position holds a token of the segment
    context: torch.Tensor  # bool [b, N]: a token before the segment's window (pooled, ranked)
    query_scale: torch.Tensor | None  # float32 [b, W]: 1 / w_i on valid slots (SnapKV buckets)
    query_valid: torch.Tensor | None  # bool [b, 1, W]: the slot is one of the segment's window
    masked: torch.Tensor | None  # bool [b, 1, W, N]: pairs of an unused query slot or a pad key
    # bool [b, 1, N]: a position whose priority key is fixed (a pad, or a protected token: the
    # sinks at off_i and the recent window), and float32 [b, 1, N] that key (-inf pad, +inf
    # protected): one `where` per bucket and layer
    fixed: torch.Tensor
    fixed_key: torch.Tensor
    # kvzip-lite buckets only (kernels.window_scores.query_max_scores, _query_max_attention):
    # int64 [b, W], the padded position of each scored query slot, -1 for unused slots;
    # ``queries`` then holds the slots
    query_pos: torch.Tensor | None = None
    # and on the host, rows by descending slot count: int64 [b] used slots, int64 [b] off_i
    slot_count: np.ndarray | None = None
    offset_host: np.ndarray | None = None
    # a kvzip-lite bucket under a window_share: the observation window's SnapKV bucket of the
    # same rows in the same order (its queries, scales and context; the same pads and fixed keys)
    window_bucket: _Bucket | None = None


@dataclass(frozen=True, slots=True)
class _Plan:
    """What one batch shape needs on the device, built once and reused by every layer."""

    whole_rows: torch.Tensor | None  # int64 [r]: requests every head keeps whole (None: none)
    whole_fill: torch.Tensor | None  # int64 [r, 1, max_k]: 0 .. n - 1, then 0
    buckets: list[_Bucket]  # the scored requests, by length bucket (or none: see runs)
    runs: list[tuple[int, int]]  # or [lo, hi) runs of equal lengths, one scorer call each
    # the scored part is one bucket of every request in batch order: its kept indices are the
    # result (no zeros, row gather or scatter into it)
    in_order: bool = False


_PLANS: dict[tuple, _Plan] = {}


def _batch_plan(
    bounds: list[int],
    whole: np.ndarray,
    scored: np.ndarray,
    snapkv: bool,
    windows: tuple[int, int, int],
    max_k: int,
    device: torch.device,
    always_buckets: bool = False,
    query_scorer: KVzipLiteScorer | None = None,
    union: bool = False,
) -> _Plan:
    """The device index tensors of a batch: the scored part cached per (bounds, scored rows,
    scorer kind, windows, device), the whole rows per (bounds, whole rows, width, device).

    ``windows`` = (scorer's observation window, sink tokens, recent window), in tokens; the
    cache key also holds ``always_buckets``, kvzip-lite's query slots and ``union``. Every
    layer of a batch asks for the same plan (layers differ only when their head groups make a
    different set of requests whole), so its tensors are uploaded once per batch, not per layer.

    The scored requests go in length buckets only for a SnapKV-family scorer (``snapkv``) or
    kvzip-lite (``query_scorer``: buckets of that scorer's query slots,
    :func:`_make_query_bucket`), and only when the batch has more runs of equal lengths than
    buckets; another scorer runs per run of equal lengths. Otherwise the plan lists the runs: one
    long segment (a prefill chunk) is cheaper as one scorer call (H200, 1 x 8,192 tokens, per
    layer: 1.59 vs 2.06 ms, benchmarks/RESULTS.md issue 20; kvzip-lite's own call also skips
    the keys no query of a block sees), and so are many segments of one length. With
    ``always_buckets`` (the scoring kernels, which read keys in place, so padding costs no
    copies) every scored request goes in a bucket.

    ``union`` (a scorer with a ``window_share``): each kvzip-lite query bucket also carries the
    observation window's SnapKV bucket of the same rows (``_Bucket.window_bucket``, built with
    :data:`~tangram_sglang.scoring.snapkv.WINDOW_SCORER`'s window); a token scorer's buckets
    are SnapKV buckets of that window already (``windows`` holds it).
    """
    starts = np.asarray(bounds[:-1], np.int64)
    lengths = np.diff(np.asarray(bounds, np.int64))
    whole_rows = whole_fill = None
    if whole.any():
        whole_rows, whole_fill = _whole_fill(bounds, whole, lengths, max_k, device)
    # The scored part does not depend on the widths (max_k) or on which requests are whole,
    # which differ from layer to layer with the head groups' ratios: every layer of a batch
    # shares it, however many distinct widths the batch's layers have.
    slots = None if query_scorer is None else (query_scorer.obs_window, query_scorer.max_queries)
    cache_key = (
        tuple(bounds),
        scored.tobytes(),
        snapkv,
        windows,  # (0, ...) for a token scorer, whose buckets need no query slots
        str(device),
        always_buckets,
        slots,
        union,
    )
    part = _PLANS.get(cache_key)
    if part is None:
        rows = np.nonzero(scored)[0]
        size = _bucket_sizes(lengths[rows])
        groups = _merge_buckets(size)
        runs = _runs(rows, lengths)
        buckets = []
        bucketed = len(runs) > len(groups) or (always_buckets and rows.size)
        if query_scorer is not None and bucketed:
            runs = []
            buckets = [
                _make_query_bucket(
                    rows[members], int(n), starts, lengths, query_scorer, windows, device
                )
                for n, members in groups
            ]
            if union:  # the window's slots over the same rows, in the same order
                window = (WINDOW_SCORER.obs_window, *windows[1:])
                buckets = [
                    replace(
                        b,
                        window_bucket=_make_bucket(
                            b.rows_host,
                            b.length,
                            starts,
                            lengths,
                            window,
                            device,
                            not always_buckets,
                        ),
                    )
                    for b in buckets
                ]
        elif snapkv and bucketed:
            runs = []
            buckets = [
                _make_bucket(
                    rows[members], int(n), starts, lengths, windows, device, not always_buckets
                )
                for n, members in groups
            ]
        in_order = len(buckets) == 1 and np.array_equal(
            buckets[0].rows_host, np.arange(len(lengths))
        )
        part = _Plan(None, None, buckets, runs, in_order)
        _remember(_PLANS, cache_key, part)
    return _Plan(whole_rows, whole_fill, part.buckets, part.runs, part.in_order)


_WHOLE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _whole_fill(
    bounds: list[int], whole: np.ndarray, lengths: np.ndarray, max_k: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``[r]`` rows every head keeps whole and their ``[r, 1, max_k]`` indices
    ``0 .. n - 1, then 0``; cached per (bounds, whole rows, width, device)."""
    key = (tuple(bounds), whole.tobytes(), max_k, str(device))
    hit = _WHOLE.get(key)
    if hit is None:
        rows = np.nonzero(whole)[0]
        cols = np.arange(max_k)
        fill = np.where(cols[None, :] < lengths[rows, None], cols[None, :], 0)
        hit = (host_to_device(rows, device), host_to_device(fill[:, None, :], device))
        _remember(_WHOLE, key, hit)
    return hit


def _remember(cache: dict, key: tuple, value: object) -> None:
    """Insert into a bounded FIFO cache (:data:`_PLAN_CACHE_SIZE` entries)."""
    if len(cache) >= _PLAN_CACHE_SIZE:
        cache.pop(next(iter(cache)))
    cache[key] = value


def _bucket_sizes(lengths: np.ndarray) -> np.ndarray:
    """Bucket length (tokens) of each segment length: the next power of two, >= MIN_BUCKET."""
    return np.maximum(MIN_BUCKET, 1 << np.ceil(np.log2(np.maximum(lengths, 1))).astype(np.int64))


def _merge_buckets(size: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """Groups of segments scored as one padded batch: ``(N, members)``, longest first.

    Each launch of the selection costs about the same host time whatever its size (20-45 us
    on an H200 host, some 30 launches per padded batch), while the padded window attention is
    small (``W`` queries per segment). So smaller power-of-two buckets are merged into the
    longest one as long as the padded batch holds at most :data:`MAX_PADDED_TOKENS` tokens
    (``b * N``) and the smaller bucket is at least ``N / MAX_MERGE_SPREAD`` long (so a long
    prefill chunk does not pad many short turns to its length); a bucket alone may exceed it.

    Args:
        size: int64 ``[r]`` bucket length of each scored segment (:func:`_bucket_sizes`).

    Returns:
        ``[(N, members)]``: the padded length (tokens) and a bool ``[r]`` mask of its segments.
    """
    groups: list[tuple[int, np.ndarray]] = []
    for n in np.unique(size)[::-1]:
        members = size == n
        if groups:
            top, held = groups[-1]
            fits = (held.sum() + members.sum()) * top <= MAX_PADDED_TOKENS
            if fits and n * MAX_MERGE_SPREAD >= top:
                groups[-1] = (top, held | members)
                continue
        groups.append((int(n), members))
    return groups


def _runs(rows: np.ndarray, lengths: np.ndarray) -> list[tuple[int, int]]:
    """``[lo, hi)`` request ranges: consecutive ``rows`` of equal length (one scorer call each)."""
    runs = []
    first = 0
    while first < len(rows):
        end = first + 1
        while (
            end < len(rows)
            and rows[end] == rows[end - 1] + 1
            and lengths[rows[end]] == lengths[rows[first]]
        ):
            end += 1
        runs.append((int(rows[first]), int(rows[end - 1]) + 1))
        first = end
    return runs


def _padded_rows(
    rows: np.ndarray,
    length: int,
    starts: np.ndarray,
    lengths: np.ndarray,
    sink_tokens: int,
    recent_window: int,
) -> tuple[np.ndarray, ...]:
    """The right-aligned layout of a bucket's rows (module docstring), host arrays:
    ``n`` [b] lengths, ``off`` [b] first real position, ``pos`` [N], ``key_valid`` [b, N],
    ``tokens`` [b, N] batch token index (0 on pad), ``protected`` [b, N] sinks and window."""
    n = lengths[rows]
    off = length - n
    pos = np.arange(length)
    key_valid = pos[None, :] >= off[:, None]
    tokens = np.where(key_valid, starts[rows, None] + pos[None, :] - off[:, None], 0)
    rel = pos[None, :] - off[:, None]  # token index within the segment
    protected = key_valid & ((rel < sink_tokens) | (pos >= length - recent_window)[None, :])
    return n, off, pos, key_valid, tokens, protected


def _fixed_keys(key_valid: np.ndarray, protected: np.ndarray, up) -> dict[str, torch.Tensor]:
    """The bucket's fixed priority keys (``fixed``, ``fixed_key`` of :class:`_Bucket`) from its
    host ``[b, N]`` masks (``protected`` holds no pad), uploaded with ``up``: a pad ranks last
    (-inf), a protected token first (+inf)."""
    fixed = (protected | ~key_valid)[:, None, :]
    fixed_key = np.where(key_valid, np.inf, -np.inf).astype(np.float32)[:, None, :]
    return {"fixed": up(fixed), "fixed_key": up(fixed_key)}


def _make_bucket(
    rows: np.ndarray,
    length: int,
    starts: np.ndarray,
    lengths: np.ndarray,
    windows: tuple[int, int, int],
    device: torch.device,
    torch_masks: bool = True,
) -> _Bucket:
    """A padded SnapKV bucket (layout: the module docstring); ``torch_masks=False`` leaves out
    the ``[b, 1, W, N]`` mask and the query-slot mask that only the torch path reads."""
    obs_window, sink_tokens, recent_window = windows
    n, off, pos, key_valid, tokens, protected = _padded_rows(
        rows, length, starts, lengths, sink_tokens, recent_window
    )
    w = np.minimum(obs_window, n)
    width = int(w.max())
    slot = np.arange(width)
    q_valid = slot[None, :] >= (width - w)[:, None]
    queries = np.where(q_valid, starts[rows, None] + n[:, None] - width + slot[None, :], 0)
    context = key_valid & (pos[None, :] < (length - w)[:, None])
    scale = np.where(q_valid, 1.0 / np.maximum(w, 1)[:, None], 0.0).astype(np.float32)
    up = lambda a: host_to_device(a, device)  # noqa: E731
    return _Bucket(
        rows=up(rows),
        rows_host=rows,
        length=length,
        window=width,
        tokens=up(tokens),
        queries=up(queries),
        offset=up(off),
        key_valid=up(key_valid),
        context=up(context),
        query_scale=up(scale),
        **_fixed_keys(key_valid, protected, up),
        query_valid=up(q_valid[:, None, :]) if torch_masks else None,
        masked=up(~(q_valid[:, None, :, None] & key_valid[:, None, None, :]))
        if torch_masks
        else None,
    )


def _make_query_bucket(
    rows: np.ndarray,
    length: int,
    starts: np.ndarray,
    lengths: np.ndarray,
    scorer: KVzipLiteScorer,
    windows: tuple[int, int, int],
    device: torch.device,
) -> _Bucket:
    """A padded bucket for kvzip-lite: each row's scored query slots (``scorer.query_slots``
    of its last ``min(obs_window, n)`` queries) and their padded positions, right-aligned as
    :func:`_make_bucket`; every real token is scored.

    The slots are right-aligned too (a row's last query in slot ``W - 1``), so slot j of every
    row sits at padded position ``<= N - W + j`` (``=`` where every query is scored): the keys
    a block of slots can count end at the same position for every row, as in one causal
    segment (:func:`_query_max_attention` and the kernel skip the rest). The rows go by
    descending slot count, so the rows a block of slots uses are a prefix of the bucket."""
    _, sink_tokens, recent_window = windows
    n = lengths[rows]
    w = np.minimum(scorer.obs_window, n)  # each row's last w queries, some of them scored
    count, in_window = slot_table(w, scorer.max_queries)  # right-aligned
    order = np.argsort(-count, kind="stable")
    rows, n, w, count, in_window = rows[order], n[order], w[order], count[order], in_window[order]
    _, off, _, key_valid, tokens, protected = _padded_rows(
        rows, length, starts, lengths, sink_tokens, recent_window
    )
    width = int(count[0])
    used = in_window >= 0
    position = np.where(used, (n - w)[:, None] + in_window, -1)  # within the segment
    bound = length - width + np.arange(width)  # slot j sits at padded position <= this
    if (used & (off[:, None] + position > bound[None, :])).any():
        raise KernelError(
            f"kvzip-lite bucket: a query slot past its right-aligned bound ({scorer}); the "
            "kernels' causal skips would drop it"
        )
    queries = np.where(used, starts[rows, None] + position, 0)
    query_pos = np.where(used, off[:, None] + position, -1)
    up = lambda a: host_to_device(a, device)  # noqa: E731
    valid = up(key_valid)
    return _Bucket(
        rows=up(rows),
        rows_host=rows,
        length=length,
        window=width,
        tokens=up(tokens),
        queries=up(queries),
        offset=up(off),
        key_valid=valid,
        context=valid,  # every real token is scored
        query_scale=None,  # the window mean's weights: not read by the query max
        **_fixed_keys(key_valid, protected, up),
        query_valid=None,
        masked=None,
        query_pos=up(query_pos),
        slot_count=count,
        offset_host=off,
    )


def _query_bucket_scores(
    scorer: KVzipLiteScorer,
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    b: _Bucket,
    sm_scale: float,
    kernel: bool = False,
) -> torch.Tensor:
    """float32 ``[b, H_kv, N]`` kvzip-lite scores of a bucket (padded layout, before the
    fixed keys: :func:`_bucket_key_of`)."""
    if kernel:
        attn = query_max_scores(
            q, k, lse, b.tokens, b.queries, b.query_pos, b.key_valid, sm_scale, scorer.local_band
        )
    else:
        attn = _query_max_attention(q, k, lse, b, sm_scale, scorer.local_band)
    pool = SnapKVScorer(kernel_size=scorer.kernel_size, pooling=scorer.pooling).pool
    return reduce_gqa(pool(attn), k.shape[1], scorer.gqa_reduce)  # [b, H_kv, N]


def _token_bucket_scores(tok: torch.Tensor, b: _Bucket) -> torch.Tensor:
    """float32 ``[b, H_kv, N]``: a token scorer's batch scores ``tok`` gathered into the
    bucket's padded layout (pads hold token 0's score; before the fixed keys)."""
    return tok[:, b.tokens].permute(1, 0, 2).float()


def _window_bucket_scores(
    scorer: SnapKVScorer,
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    b: _Bucket,
    sm_scale: float,
    window_kernel: bool = False,
) -> torch.Tensor:
    """float32 ``[b, H_kv, N]`` SnapKV scores of a bucket (padded layout, before the fixed
    keys: :func:`_bucket_key_of`): ``scorer.score`` of each row, the window's tokens above its
    context, pads at that top value."""
    if window_kernel:  # the window attention below, in one launch (kernels.window_scores)
        attn = window_scores(q, k, lse, b.tokens, b.queries, b.query_scale, b.context, sm_scale)
    else:
        attn = _window_attention(q, k, lse, b, sm_scale)
    scores = reduce_gqa(scorer.pool(attn), k.shape[1], scorer.gqa_reduce)  # [b, H_kv, N]
    # The window scores above the segment's context (kvpress: max + 1; NaN if any is NaN).
    ctx = b.context.unsqueeze(1)
    top = scores.masked_fill(~ctx, float("-inf")).amax(dim=(1, 2)) + 1.0  # [b]
    top = top.masked_fill(top == float("-inf"), 0.0)  # no context: every token ties at 0
    return torch.where(ctx, scores, top.view(-1, 1, 1))


def _window_attention(
    q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, b: _Bucket, sm_scale: float
) -> torch.Tensor:
    """float32 ``[b, H_q, N]`` mean window attention per context token (torch ops)."""
    num_kv_heads, dim = k.shape[1], k.shape[2]
    num_qo_heads = q.shape[1]
    bsz, width, length = b.queries.shape[0], b.window, b.length
    # Window attention of the bucket, in place: logits [b, H_kv, gqa * W, N] (query heads of a
    # KV head folded into the query axis, as scoring.snapkv.window_attention), minus the LSE of
    # history + segment, pad keys and unused query slots at -inf, exp. No causal mask: it only
    # hides window keys from earlier window queries, and window keys are not scored (they rank
    # as the window below); every window query sees every context key.
    q_obs = q[b.queries].float().permute(0, 2, 1, 3)  # [b, Hq, W, D]
    q_obs = q_obs.reshape(bsz, num_kv_heads, -1, dim)  # [b, H_kv, gqa * W, D]
    k_pad = k[b.tokens].float().permute(0, 2, 3, 1)  # [b, H_kv, D, N]
    logits = torch.matmul(q_obs, k_pad).mul_(sm_scale)
    logits = logits.view(bsz, num_qo_heads, width, length)
    lse_obs = torch.where(b.query_valid, lse[b.queries].float().transpose(1, 2), 0.0)
    logits.sub_(lse_obs.unsqueeze(-1)).masked_fill_(b.masked, float("-inf")).exp_()
    # Mean over each segment's own window queries (weights 1 / w_i), then 0 past its context
    # (the per-segment path pools the context alone, with zero padding).
    attn = torch.matmul(b.query_scale.view(bsz, 1, 1, width), logits).squeeze(2)  # [b, Hq, N]
    return torch.where(b.context.unsqueeze(1), attn, 0.0)


def _query_max_attention(
    q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, b: _Bucket, sm_scale: float, band: int
) -> torch.Tensor:
    """float32 ``[b, H_q, N]``: kvzip-lite's query max of a padded bucket with torch ops.

    The same values as ``kernels.window_scores.query_max_scores`` (its docstring has the
    formula): ``exp(max_j(sm_scale * q_j . k_p - lse_j))`` over the bucket row's query slots j
    at padded position ``query_pos[j] >= p + band``, 0 where none counts or ``p`` is a pad. The
    slots go in blocks of at most :data:`MAX_QUERY_BLOCK_FLOATS` logits, each block as one
    product with the ``-lse`` folded in (a ``-lse`` column on q, a row of ones on k, as
    ``KVzipLiteScorer.score``): about 12 launches per block whatever the bucket's lengths. Slot
    j sits at position ``<= N - W + j`` (:func:`_make_query_bucket`), so a block of slots
    ``[j0, j1)`` counts no key at or past ``N - W + j1 - band``, and only the rows with a slot
    in it take part (a prefix: rows by descending slot count), from the first real key of the
    longest of them: the rest is not computed (host ints, no sync).
    """
    num_kv_heads, dim = k.shape[1], k.shape[2]
    num_qo_heads = q.shape[1]
    bsz, length = b.tokens.shape
    slots = b.queries.shape[1]
    k_aug = k.new_ones(bsz, num_kv_heads, dim + 1, length, dtype=torch.float32)
    k_aug[:, :, :dim] = k[b.tokens].permute(0, 2, 3, 1)  # [b, H_kv, D, N] keys, a row of ones
    key_pos = torch.arange(length, device=k.device)
    pad = ~b.key_valid.view(bsz, 1, 1, length)
    best = torch.full((bsz, num_qo_heads, length), float("-inf"), device=k.device)
    step = max(1, MAX_QUERY_BLOCK_FLOATS // max(1, bsz * num_qo_heads * length))
    for first in range(0, slots, step):
        end = min(first + step, slots)
        hi = min(length, length - slots + end - band)  # keys >= hi: no slot of the block counts
        rows = int(np.count_nonzero(b.slot_count > slots - end))  # rows with a slot here
        lo = int(b.offset_host[:rows].min()) if rows else hi  # keys < lo: pads of those rows
        if hi <= lo:
            continue
        tok = b.queries[:rows, first:end]  # [r, m]
        q_blk = q[tok].float().mul_(sm_scale)  # [r, m, H_q, D]
        q_aug = torch.cat([q_blk, lse[tok].float().neg_().unsqueeze(-1)], dim=-1)
        q_aug = q_aug.transpose(1, 2).reshape(rows, num_kv_heads, -1, dim + 1)  # GQA folded
        logits = torch.matmul(q_aug, k_aug[:rows, ..., lo:hi])
        logits = logits.view(rows, num_qo_heads, end - first, hi - lo)
        # unused slots (query_pos -1) see no key; pad keys sit before every real query
        early = b.query_pos[:rows, first:end, None] - key_pos[lo:hi] < band  # [r, m, hi - lo]
        logits.masked_fill_(early.unsqueeze(1) | pad[:rows, ..., lo:hi], float("-inf"))
        seen = best[:rows, :, lo:hi]
        torch.maximum(seen, logits.amax(dim=2), out=seen)
    return best.exp_()


def _score_runs(
    out: torch.Tensor,
    scorer: Scorer,
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    bounds: list[int],
    kept_host: np.ndarray,
    kept_dev: torch.Tensor,
    runs: list[tuple[int, int]],
    sm_scale: float,
    sink_tokens: int,
    recent_window: int,
    tok: torch.Tensor | None = None,
    share: float = 0.0,
) -> None:
    """``runs`` (``[lo, hi)`` requests of equal length, :func:`_runs`): one scorer call each,
    or, with a token scorer's batch scores ``tok`` (``[H_kv, num_tokens]``), a view of them
    (fused with the window's under a ``window_share``, ``share``: :func:`_run_key`)."""
    windows = (sink_tokens, recent_window)
    for lo, hi in runs:
        run_max = int(kept_host[lo:hi].max())
        key = _run_key(scorer, q, k, lse, bounds, lo, hi, sm_scale, windows, tok, share)
        out[lo:hi, :, :run_max] = kept_from_ranks(key, kept_dev[lo:hi], run_max)


def _run_key(
    scorer: Scorer,
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    bounds: list[int],
    lo: int,
    hi: int,
    sm_scale: float,
    windows: tuple[int, int],
    tok: torch.Tensor | None = None,
    share: float = 0.0,
) -> torch.Tensor:
    """float32 ``[hi - lo, H_kv, n]`` priority keys of requests ``[lo, hi)``, all ``n`` tokens
    long (``scoring.select.priority_key``: protected tokens +inf, NaN -inf); the scores are
    the scorer's on the run (kvzip-lite's ``score`` fuses its ``window_share`` itself), or the
    run's columns of a token scorer's batch scores ``tok``, fused with
    :data:`~tangram_sglang.scoring.snapkv.WINDOW_SCORER`'s of the run under a ``window_share``
    (``share`` > 0: ``scoring.select.window_union``)."""
    n = bounds[lo + 1] - bounds[lo]
    if tok is not None:
        run = tok[:, bounds[lo] : bounds[lo] + (hi - lo) * n]
        scores = run.reshape(tok.shape[0], hi - lo, n).transpose(0, 1)  # [m, H_kv, n]
        if share:
            window = _score_run(WINDOW_SCORER, q, k, lse, bounds[lo], hi - lo, n, sm_scale)
            scores = window_union(scores, window, share)
    else:
        scores = _score_run(scorer, q, k, lse, bounds[lo], hi - lo, n, sm_scale)
    return priority_key(scores, *windows, protected=_protected(n, *windows, scores.device))


_PROTECTED: dict[tuple, torch.Tensor] = {}


def _protected(n: int, sink_tokens: int, recent_window: int, device: torch.device) -> torch.Tensor:
    """``scoring.select.protected_mask`` (bool ``[n]``), cached per (n, windows, device): a
    run's protected tokens cost no launch after the batch's first layer."""
    key = (n, sink_tokens, recent_window, str(device))
    mask = _PROTECTED.get(key)
    if mask is None:
        mask = protected_mask(n, sink_tokens, recent_window, device)
        _remember(_PROTECTED, key, mask)
    return mask


def reference_kept_indices(
    scorer: Scorer,
    q: torch.Tensor,
    k_new: torch.Tensor,
    lse: torch.Tensor,
    bounds: list[int],
    kept_per_head: Sequence[Sequence[int]] | np.ndarray,
    sm_scale: float,
    sink_tokens: int,
    recent_window: int,
    v_new: torch.Tensor | None = None,
    layer_id: int | None = None,
) -> torch.Tensor:
    """:func:`batch_kept_indices` one request and one distinct ``k_g`` at a time (the oracle).

    The straightforward form (the backend's path before the batched one): per request, the
    scorer on its segment, then :func:`~tangram_sglang.scoring.select.select_kept` for the
    heads of each distinct ``k_g``. Tests and ``bench.prefill_profile`` compare against it.
    Arguments and result as :func:`batch_kept_indices`.
    """
    kept_host = np.asarray(kept_per_head, np.int64).reshape(len(bounds) - 1, k_new.shape[1])
    bs, num_kv_heads = kept_host.shape
    max_k = int(kept_host.max()) if kept_host.size else 1
    out = torch.zeros(bs, num_kv_heads, max(max_k, 1), dtype=torch.int64, device=k_new.device)
    for i in range(bs):
        start, end = bounds[i], bounds[i + 1]
        n = end - start
        if n == 0:
            continue
        if int(kept_host[i].min()) == n:
            out[i, :, :n] = torch.arange(n, device=k_new.device)
            continue
        if is_token_scorer(scorer) and window_share_of(scorer):  # the HF side's union form
            w = min(WINDOW_SCORER.obs_window, n)
            scores = scorer.union_scores(
                layer_id,
                k_new[start:end].transpose(0, 1),
                v_new[start:end].transpose(0, 1),
                q[end - w : end].transpose(0, 1),
                sm_scale,
                lse_obs=lse[end - w : end].transpose(0, 1),
            )
        elif is_token_scorer(scorer):
            scores = scorer.token_scores(
                layer_id, k_new[start:end].transpose(0, 1), v_new[start:end].transpose(0, 1)
            )
        else:
            w = min(scorer.obs_window, n)
            scores = scorer.score(
                q[end - w : end].transpose(0, 1),
                k_new[start:end].transpose(0, 1),
                sm_scale,
                lse_obs=lse[end - w : end].transpose(0, 1),
            )
        for k in sorted(set(kept_host[i].tolist())):
            heads = [h for h in range(num_kv_heads) if kept_host[i, h] == k]
            idx = torch.tensor(heads, device=k_new.device)
            out[i, idx, :k] = select_kept(scores[idx], k, sink_tokens, recent_window)
    return out
