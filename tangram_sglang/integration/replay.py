"""The scheduler side of the replay pass: KVzip's repeat prompt added to an extend batch.

Under a replay scorer (``--tangram-scorer kvzip``, ``scoring.kvzip``) every segment the server
compresses is scored by a replay of it, run in the same forward: after SGLang's
``ScheduleBatch.prepare_for_extend`` built the batch (and Tangram allocated its pages in
``alloc_for_extend``), :func:`add_replay_tokens` puts, in front of each compressed row's
segment, the repeat prompt and the segment's ids again. The replay tokens need no KV slot and no
page (their K/V are never stored), so the radix tree, the prefix lengths and admission see the
batch as before; only the flat ``input_ids``, ``extend_lens``, ``extend_num_tokens`` and
``out_cache_loc`` (SGLang's padding slot 0 for each replay token) grow,
and the batch records the replay lengths (:data:`REPLAY_ATTR`) for the attention backend and the
positions (``backend.replay``). SGLang samples from each row's last flat token, which is still
the segment's last.

Prompts (KVzip, kvpress 0.5.5 ``KVzipPress.prepare``): a segment from the start of the sequence
is replayed after "Repeat the previous context exactly."; a later one (a later chunk, or a new
turn after a cached prefix) after "Repeat the part of the previous context exactly, starting
with" and the 8 tokens before the segment. Both end with the chat template's assistant header
where the tokenizer has a chat template, as in KVzip.

Requests that return logprobs or hidden states, or send input embeddings, are refused at the
HTTP edge under a replay scorer (``edge_checks``): the replay tokens would shift SGLang's
per-token arithmetic for them. SGLang's prefill metrics (``total_prefill_uncached_tokens``,
the prefill throughput of its log lines) count the replay tokens as prompt tokens; the replay
tokens alone are in ``/server_info``'s ``tangram_pool.replay_tokens``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tangram_sglang.backend.replay import row_offsets
from tangram_sglang.errors import KernelError
from tangram_sglang.host_copy import host_to_device

REPLAY_ATTR = "_tangram_replay_lens"  # ScheduleBatch attribute: replay tokens per row, or None


def add_replay_tokens(batch: Any, state: Any) -> None:
    """AFTER ``ScheduleBatch.prepare_for_extend``: add each compressed row's replay tokens.

    A row replays when its segment is compressed (some head group keeps fewer than ``n`` of
    its tokens, from the scheduler's allocation ``state.extend_plans``). Sets
    :data:`REPLAY_ATTR` on the batch (None when no row replays) and counts the replay tokens
    in ``state.replay_tokens``.

    Raises:
        KernelError: a row without the scheduler's allocation of its segment, a batch that
            returns logprobs or carries input embeddings (the edge check refuses both under a
            replay scorer).
    """
    setattr(batch, REPLAY_ATTR, None)
    prompts = state.replay_prompts
    if prompts is None or not batch.forward_mode.is_extend() or batch.forward_mode.is_mixed():
        return
    rows = np.asarray(batch.req_pool_indices_cpu, np.int64).reshape(-1).tolist()
    replays: list[list[int]] = []
    for req, row, n, prefix in zip(
        batch.reqs, rows, batch.extend_lens, batch.prefix_lens, strict=True
    ):
        entry = state.extend_plans.get(int(row))
        if entry is None or entry[0] != int(n):
            raise KernelError(
                f"Tangram replay: row {row} extends {n} tokens without the scheduler's "
                "allocation of that segment (the alloc_for_extend hook did not run)"
            )
        compressed = int(n) > 0 and bool(np.any(entry[2] < int(n)))
        fill = req.get_fill_ids() if hasattr(req, "get_fill_ids") else req.fill_ids
        replays.append(prompts.ids_for(fill, int(prefix), int(n)) if compressed else [])
    if not any(replays):
        return
    flat = batch.prefill_input_ids_cpu
    embeds = batch.input_embeds is not None or getattr(batch, "replace_embeds", None) is not None
    if flat is None or embeds:
        raise KernelError(
            "Tangram replay: an extend batch with input embeddings has segments to compress; "
            "--tangram-scorer kvzip replays token ids only (the edge check refuses "
            "input_embeds under it)"
        )
    if batch.return_logprob:
        raise KernelError(
            "Tangram replay: a batch that returns logprobs reached the replay; the edge check "
            "must refuse logprobs under --tangram-scorer kvzip"
        )
    pieces, start = [], 0
    for ids, n in zip(replays, batch.extend_lens, strict=True):
        pieces.append(torch.tensor(ids, dtype=flat.dtype))
        pieces.append(flat[start : start + int(n)])
        start += int(n)
    merged = torch.cat(pieces)
    if flat.is_pinned():
        merged = merged.pin_memory()
    lens = [len(ids) for ids in replays]
    batch.out_cache_loc = _with_replay_slots(batch.out_cache_loc, batch.extend_lens, lens)
    batch.prefill_input_ids_cpu = merged
    batch.extend_lens = [int(n) + m for n, m in zip(batch.extend_lens, lens, strict=True)]
    batch.extend_num_tokens = int(batch.extend_num_tokens) + sum(lens)
    setattr(batch, REPLAY_ATTR, lens)
    state.replay_tokens += sum(lens)


def _with_replay_slots(
    out_cache_loc: torch.Tensor, segment_lens: list[int], replay_lens: list[int]
):
    """``out_cache_loc`` with slot 0 (SGLang's padding slot) in front of each row's segment
    for its replay tokens: SGLang copies every per-token field by the batch's token count; the
    Tangram backend writes K/V by its own page table and never reads these slots."""
    seg = np.asarray(segment_lens, np.int64)
    replay = np.asarray(replay_lens, np.int64)
    flat = seg + replay
    _, t = row_offsets(flat)  # index within the flat row
    m = np.repeat(replay, flat)
    old_start = np.repeat(np.cumsum(seg) - seg, flat)
    index = np.where(t < m, 0, 1 + old_start + t - m)  # 0: the padding slot
    padded = torch.cat([out_cache_loc.new_zeros(1), out_cache_loc])
    return padded.index_select(0, host_to_device(index, out_cache_loc.device))
