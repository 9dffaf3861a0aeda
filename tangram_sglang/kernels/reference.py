"""Pure-torch decode, extend and kept-KV write over ragged per-group page tables.

This is both the CPU serving path (SGLang on CPU calls it per layer) and the oracle the Triton
kernels are tested against. It follows docs/contracts.md exactly:

    k_pool, v_pool   [num_pages, H_p, page_size, D]      page 0 = padding
    page_table       [max_rows, num_head_groups, max_pages_per_group]  int32
    group_len        [max_rows, num_head_groups]                       int32 (kept tokens)
    KV head h of the layer: group g = group_of_head[h], column c = column_of_head[h];
    token t of (row r, group g) sits at k_pool[page_table[r, g, t // page_size], c, t % page_size]

Everything is vectorised over (batch entry, KV head): whole pages are gathered at once (a page's
column is one contiguous ``[page_size, D]`` block), GQA query heads attend through one batched
matmul, and padding positions are masked. Computation is float32 (float64 inputs stay float64).
Unlike the Triton launchers these functions read lengths back to the host (``.max()``), so they
are not CUDA-graph safe; they are meant for CPU.
"""

from __future__ import annotations

import torch

from tangram_sglang.kernels import _checks

# Extend processes queries in chunks so that the [heads, chunk, keys] score tensor stays below
# this many elements (~128 MiB of float32): bounded memory for long prefills on CPU.
_EXTEND_SCORE_ELEMS = 1 << 25


def gather_tokens(
    pool: torch.Tensor,
    page_table: torch.Tensor,
    rows: torch.Tensor,
    group_of_head: torch.Tensor,
    column_of_head: torch.Tensor,
    max_len: int,
) -> torch.Tensor:
    """Gather the first ``max_len`` kept tokens of every (row, KV head) (page-granular).

    Args:
        pool: ``[num_pages, H_p, page_size, D]`` K or V pool.
        page_table: int32 ``[max_rows, num_head_groups, max_pages_per_group]``.
        rows: int ``[n]``: page-table rows to read.
        group_of_head, column_of_head: int ``[H_kv]``.
        max_len: tokens to gather per (row, head) (>= 0); entries past a head's length hold
            whatever the table points at (page 0 for unused entries) and must be masked.

    Returns:
        ``[n, H_kv, max_len, D]`` in the pool's dtype.
    """
    num_page_slots, heads_per_group, page_size, head_dim = pool.shape
    num_pages = -(-max_len // page_size)
    groups, cols = group_of_head.long(), column_of_head.long()
    pages = page_table[rows.long()[:, None], groups[None, :], :num_pages].long()  # [n, H, P]
    n, num_heads = pages.shape[0], pages.shape[1]
    if pool.is_contiguous():
        # One (page, column) block is a contiguous [page_size * D] row: index_select copies
        # whole rows, several times faster on CPU than 2-D advanced indexing.
        flat = pool.view(num_page_slots * heads_per_group, page_size * head_dim)
        block_ids = (pages * heads_per_group + cols[None, :, None]).reshape(-1)
        blocks = torch.index_select(flat, 0, block_ids)
    else:
        blocks = pool[pages, cols[None, :, None]]  # [n, H, P, page_size, D]
    return blocks.reshape(n, num_heads, num_pages * page_size, head_dim)[:, :, :max_len]


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention; rows with no visible key give output 0 and lse -inf (no NaN).

    Args:
        q: ``[..., M, D]``; k, v: ``[..., N, D]``; mask: bool ``[..., M, N]`` (True = visible).

    Returns:
        ``(out [..., M, D], lse [..., M])`` with lse the natural-log softmax normaliser.
    """
    if k.shape[-2] == 0:  # no keys at all (every group of the batch empty)
        out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        return out, torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    # In-place passes over the [..., M, N] score tensor: it dominates CPU time and memory.
    scores = torch.matmul(q * sm_scale, k.transpose(-1, -2))
    scores.masked_fill_(~mask, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    probs = scores.sub_(row_max).exp_()
    denom = probs.sum(dim=-1, keepdim=True)
    out = torch.matmul(probs, v) / torch.where(denom > 0, denom, torch.ones_like(denom))
    lse = (row_max + torch.log(denom)).squeeze(-1)  # log(0) = -inf for empty rows
    return out, lse


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def decode_reference(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    group_len: torch.Tensor,
    req_rows: torch.Tensor,
    group_of_head: torch.Tensor,
    column_of_head: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of one layer: one query token per batch entry over its kept tokens.

    Args:
        q: ``[bs, num_qo_heads, D]``, the pool's dtype.
        k_pool, v_pool: ``[num_pages, H_p, page_size, D]``.
        page_table: int32 ``[max_rows, num_head_groups, max_pages_per_group]``.
        group_len: int32 ``[max_rows, num_head_groups]``: kept tokens, INCLUDING the token being
            decoded (its K/V already written).
        req_rows: int32 ``[bs]``: page-table row of each batch entry (req_pool_idx).
        group_of_head, column_of_head: int32 ``[H_kv]``: this layer's head -> (group, column).
        sm_scale: softmax scale (usually ``D ** -0.5``).
        out: optional ``[bs, num_qo_heads, D]`` (q's dtype) written in place.

    Returns:
        ``out``; a head with 0 kept tokens gives zeros. GQA: query heads ``h * gqa_size ...
        (h + 1) * gqa_size - 1`` read KV head ``h``.

    Raises:
        KernelError: shapes, dtypes or devices do not match the contract.

    Source: docs/contracts.md (decode); Tangram arXiv 2606.06302 (ragged paging).
    """
    bs, num_qo_heads = _checks.check_query(q, k_pool)
    _checks.check_pools(k_pool, v_pool, q.device)
    num_kv_heads = _checks.num_kv_heads_of(group_of_head, q.device)
    _checks.check_sm_scale(sm_scale)
    _checks.check_paging(
        page_table, group_len, req_rows, group_of_head, column_of_head, bs, num_kv_heads, q.device
    )
    gqa = _checks.gqa_size_of(num_qo_heads, num_kv_heads)
    if out is None:
        out = torch.empty_like(q)
    _checks.check_tensor("out", out, tuple(q.shape), (q.dtype,), q.device)
    if bs == 0:
        return out
    rows = req_rows.long()
    lens = group_len[rows[:, None], group_of_head.long()[None, :]].long()  # [bs, H_kv]
    max_len = int(lens.max())
    dtype = _compute_dtype(q.dtype)
    keys = gather_tokens(k_pool, page_table, rows, group_of_head, column_of_head, max_len)
    values = gather_tokens(v_pool, page_table, rows, group_of_head, column_of_head, max_len)
    visible = torch.arange(max_len, device=q.device)[None, None, :] < lens[:, :, None]
    qh = q.reshape(bs, num_kv_heads, gqa, -1).to(dtype)
    o, _ = attend(qh, keys.to(dtype), values.to(dtype), visible[:, :, None, :], sm_scale)
    out.copy_(o.reshape(bs, num_qo_heads, -1))
    return out


def extend_reference(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    qo_indptr: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    group_len: torch.Tensor,
    req_rows: torch.Tensor,
    group_of_head: torch.Tensor,
    column_of_head: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Extend attention of one layer: new tokens over compressed history + causal new tokens.

    Args:
        q: ``[num_tokens, num_qo_heads, D]`` queries of the new tokens (post-RoPE).
        k_new, v_new: ``[num_tokens, H_kv, D]`` transient K/V of the new tokens (not in the pool).
        qo_indptr: int32 ``[bs + 1]``: request i owns tokens ``qo_indptr[i]:qo_indptr[i + 1]``.
        k_pool, v_pool, page_table, req_rows, group_of_head, column_of_head: as in
            :func:`decode_reference` (``req_rows [bs]``).
        group_len: int32 ``[max_rows, num_head_groups]``: kept HISTORY tokens (before this
            segment); 0 for a request without history.
        sm_scale: softmax scale.
        out: optional ``[num_tokens, num_qo_heads, D]`` (q's dtype), written in place.
        lse: optional float32 ``[num_tokens, num_qo_heads]``, written in place.

    Returns:
        ``(out, lse)``: lse is the natural-log softmax normaliser over history + visible new keys
        (with ``sm_scale`` applied), which the scorer uses to normalise observation-window scores.

    Raises:
        KernelError: shapes, dtypes or devices do not match the contract.

    Source: docs/contracts.md (extend); docs/design.md §3.1 (attention over [history + transient]).
    """
    num_tokens, num_qo_heads, num_kv_heads, bs = _checks.check_extend_args(
        q,
        k_new,
        v_new,
        qo_indptr,
        k_pool,
        v_pool,
        page_table,
        group_len,
        req_rows,
        group_of_head,
        column_of_head,
    )
    _checks.check_sm_scale(sm_scale)
    gqa = num_qo_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if lse is None:
        lse = torch.empty(num_tokens, num_qo_heads, dtype=torch.float32, device=q.device)
    _checks.check_tensor("out", out, tuple(q.shape), (q.dtype,), q.device)
    _checks.check_tensor("lse", lse, (num_tokens, num_qo_heads), (torch.float32,), q.device)
    dtype = _compute_dtype(q.dtype)
    bounds = qo_indptr.tolist()
    hist_lens = group_len[req_rows.long()[:, None], group_of_head.long()[None, :]].long()
    for i in range(bs):
        start, end = bounds[i], bounds[i + 1]
        if end == start:
            continue
        row = req_rows[i : i + 1]
        max_hist = int(hist_lens[i].max())
        keys = gather_tokens(k_pool, page_table, row, group_of_head, column_of_head, max_hist)[0]
        values = gather_tokens(v_pool, page_table, row, group_of_head, column_of_head, max_hist)[0]
        keys = torch.cat([keys, k_new[start:end].transpose(0, 1)], dim=1).to(dtype)  # [H, K, D]
        values = torch.cat([values, v_new[start:end].transpose(0, 1)], dim=1).to(dtype)
        _extend_one(
            q[start:end],
            keys,
            values,
            hist_lens[i],
            max_hist,
            gqa,
            sm_scale,
            out[start:end],
            lse[start:end],
        )
    return out, lse


def _extend_one(q, keys, values, hist_lens, max_hist, gqa, sm_scale, out, lse) -> None:
    """One request: queries ``[n, Hq, D]`` over ``keys [H_kv, max_hist + n, D]``, chunked."""
    n, num_qo_heads, _ = q.shape
    num_kv_heads, num_keys = keys.shape[0], keys.shape[1]
    key_pos = torch.arange(num_keys, device=q.device)
    hist_visible = key_pos[None, :] < hist_lens[:, None]  # [H_kv, K] (history part)
    chunk = max(1, _EXTEND_SCORE_ELEMS // max(1, num_qo_heads * num_keys))
    for q0 in range(0, n, chunk):
        q1 = min(n, q0 + chunk)
        num_vis = max_hist + q1  # new keys past this chunk's last query are never visible
        query_pos = torch.arange(q0, q1, device=q.device)
        causal = (key_pos[None, :num_vis] - max_hist) <= query_pos[:, None]  # [m, K]
        is_new = key_pos[:num_vis] >= max_hist
        visible = torch.where(is_new[None, None, :], causal[None], hist_visible[:, None, :num_vis])
        qh = q[q0:q1].to(keys.dtype).reshape(q1 - q0, num_kv_heads, gqa, -1).permute(1, 2, 0, 3)
        o, row_lse = attend(
            qh, keys[:, None, :num_vis], values[:, None, :num_vis], visible[:, None], sm_scale
        )
        out[q0:q1].copy_(o.permute(2, 0, 1, 3).reshape(q1 - q0, num_qo_heads, -1))
        lse[q0:q1].copy_(row_lse.permute(2, 0, 1).reshape(q1 - q0, num_qo_heads))


def kv_write_reference(
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    qo_indptr: torch.Tensor,
    kept_idx: torch.Tensor,
    kept_count: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    group_len: torch.Tensor,
    req_rows: torch.Tensor,
    group_of_head: torch.Tensor,
    column_of_head: torch.Tensor,
) -> None:
    """Write each head's selected new tokens into its group's reserved pages (one layer).

    Head h of request i copies ``k_new/v_new[qo_indptr[i] + kept_idx[i, h, j]]`` for
    ``j < kept_count[i, g]`` (g = group_of_head[h]) to group token ``group_len[row, g] + j``, i.e.
    slot ``t % page_size`` of page ``page_table[row, g, t // page_size]``, column
    ``column_of_head[h]``. ``group_len`` is NOT updated (the caller advances it once per segment,
    after every layer has written). Also serves the decode append (``kept_idx`` = 0, count 1).

    Args:
        k_new, v_new: ``[num_tokens, H_kv, D]`` transient K/V, the pool's dtype.
        qo_indptr: int32 ``[bs + 1]``.
        kept_idx: int32/int64 ``[bs, H_kv, max_k]``: indices into the request's new tokens.
        kept_count: int32 ``[bs, num_head_groups]``: tokens kept by each group (k_g).
        k_pool, v_pool, page_table, group_len, req_rows, group_of_head, column_of_head: as in
            :func:`decode_reference`; the destination pages must already be in ``page_table``.

    Raises:
        KernelError: shapes, dtypes or devices do not match the contract.

    Ownership: writes only pages of ``page_table[req_rows]`` reserved for this segment.
    """
    max_k = _checks.check_kv_write_args(
        k_new,
        v_new,
        qo_indptr,
        kept_idx,
        kept_count,
        k_pool,
        v_pool,
        page_table,
        group_len,
        req_rows,
        group_of_head,
        column_of_head,
    )
    rows, groups, cols = req_rows.long(), group_of_head.long(), column_of_head.long()
    counts = kept_count[:, groups].long()  # [bs, H_kv]
    page_size = k_pool.shape[2]
    bs, num_kv_heads = counts.shape
    j = torch.arange(max_k, device=k_new.device)
    valid = j[None, None, :] < counts[:, :, None]  # [bs, H_kv, max_k]
    src = qo_indptr[:-1].long()[:, None, None] + kept_idx.long()
    dst = group_len[rows[:, None], groups[None, :]].long()[:, :, None] + j
    page = page_table[
        rows[:, None, None],
        groups[None, :, None],
        (dst // page_size).clamp(max=page_table.shape[2] - 1),
    ].long()
    heads = torch.arange(num_kv_heads, device=k_new.device)[None, :, None].expand_as(valid)
    col = cols[None, :, None].expand_as(valid)
    sel_page, sel_col, sel_slot = page[valid], col[valid], (dst % page_size)[valid]
    k_pool[sel_page, sel_col, sel_slot] = k_new[src[valid], heads[valid]]
    v_pool[sel_page, sel_col, sel_slot] = v_new[src[valid], heads[valid]]
