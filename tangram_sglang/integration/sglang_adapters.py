"""Present Tangram's page pool to SGLang's KV-cache interfaces (scheduler process, start-up).

SGLang keeps its token-slot bookkeeping (``req_to_token`` rows, ``out_cache_loc``, the token
allocator's free list): these are *logical* slot ids, int32 per token, nothing per layer. What
changes under ``--tangram``:

* cell size: SGLang sizes ``max_total_num_tokens = KV bytes // cell size``. The Tangram cell is
  the full cell x :func:`~tangram_sglang.integration.profile_loader.padded_kept_fraction`, so the
  same bytes give more logical tokens (the capacity gain).
* the token KV pool: :class:`TangramTokenToKVPool` (a ``NoOpMHATokenToKVPool``: tiny placeholder
  buffers, raises on real ``set_kv_buffer``/``get_*_buffer``) instead of SGLang's full-size
  per-layer buffers; it carries the Tangram page pool (:class:`~tangram_sglang.mem.kv_pool.
  KVPool`) sized from the same bytes: ``max_total_num_tokens x Tangram cell``.
* freeing a request row (``ReqToTokenPool.free``: finish, abort, retraction all go through it)
  releases the row's pages.

Source: integration/README.md §4 (pool construction and sizing, recommended route).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from sglang.srt.mem_cache.memory_pool import NoOpMHATokenToKVPool

from tangram_sglang.integration import profile_loader
from tangram_sglang.integration.server_args import profile_from_server_args
from tangram_sglang.mem.kv_pool import KVPool, bytes_per_page, num_pages_for_budget
from tangram_sglang.mem.reservation import decode_tail_tokens
from tangram_sglang.profile import BudgetProfile

logger = logging.getLogger(__name__)


def tangram_on(server_args: Any) -> bool:
    """Whether this server runs with ``--tangram``."""
    return bool(getattr(server_args, "tangram", False))


def full_cell_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes SGLang's uniform pool spends per token: K and V of every layer and KV head."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * num_kv_heads * head_dim * itemsize


def tangram_cell_bytes(full_cell: int, profile: BudgetProfile) -> int:
    """Tangram bytes per logical token (long segments): full cell x padded kept fraction."""
    return max(1, math.ceil(full_cell * profile_loader.padded_kept_fraction(profile)))


class TangramTokenToKVPool(NoOpMHATokenToKVPool):
    """SGLang's KV pool slot under ``--tangram``: placeholders + the Tangram page pool.

    SGLang constructs it with ``MHATokenToKVPool``'s arguments (``size`` = logical token slots,
    honoured for admission); :meth:`attach_tangram` then allocates the page pool. The attention
    backend builds the :class:`~tangram_sglang.backend.state.TangramState` on it.
    """

    tangram_kv_pool: KVPool | None = None
    tangram_profile: BudgetProfile | None = None
    tangram_state: Any = None  # TangramState, set by the attention backend
    full_kv_bytes_per_token: int = 0  # bytes, all layers, K + V

    def attach_tangram(
        self, profile: BudgetProfile, page_size: int, budget_bytes: int, full_cell: int
    ) -> None:
        """Allocate the Tangram page pool in ``budget_bytes`` (start-up).

        Raises:
            PoolError: the budget holds fewer than 2 pages.
        """
        h_p, dim = profile.grouping.heads_per_group, profile.model.head_dim
        num_pages = num_pages_for_budget(
            budget_bytes, bytes_per_page(h_p, page_size, dim, self.store_dtype)
        )
        self.tangram_kv_pool = KVPool.create(
            num_pages, h_p, page_size, dim, self.store_dtype, self.device
        )
        self.tangram_profile = profile
        self.full_kv_bytes_per_token = int(full_cell)
        self.mem_usage = self.tangram_kv_pool.num_pages * self.tangram_kv_pool.bytes_per_page / (
            1 << 30)  # fmt: skip
        logger.info(
            "Tangram KV pool: %d pages x %d bytes = %.3f GB (H_p=%d, page_size=%d, D=%d) for %d "
            "logical token slots; SGLang's full-size token K/V buffers not allocated",
            num_pages, self.tangram_kv_pool.bytes_per_page, self.mem_usage, h_p, page_size, dim,
            self.size,
        )  # fmt: skip

    def get_kv_size_bytes(self):
        """K and V bytes of the Tangram page pool (what SGLang reports as the KV cache)."""
        half = self.tangram_kv_pool.k_pool.numel() * self.tangram_kv_pool.k_pool.element_size()
        return half, half


def compute_cell_size(original, configurator: Any, kvc: Any, num_layers: int) -> int:
    """AROUND ``DefaultPoolConfigurator._compute_cell_size``: the Tangram cell under --tangram."""
    full = original(configurator, kvc, num_layers)
    if not tangram_on(kvc.server_args):
        return full
    cell = tangram_cell_bytes(full, profile_from_server_args(kvc.server_args))
    logger.info("Tangram: %d bytes per logical token (full KV %d)", cell, full)
    return cell


def build_mha_kv_pool(original, kvc: Any, **kwargs: Any) -> Any:
    """AROUND ``KVCacheConfigurator._build_mha_kv_pool``: the Tangram pool under --tangram."""
    if not tangram_on(kvc.server_args):
        return original(kvc, **kwargs)
    kwargs["mha_pool_class"] = TangramTokenToKVPool
    pool = original(kvc, **kwargs)
    profile = profile_from_server_args(kvc.server_args)
    m = profile.model
    full = full_cell_bytes(m.num_layers, m.num_kv_heads, m.head_dim, pool.store_dtype)
    budget = kwargs["max_total_num_tokens"] * tangram_cell_bytes(full, profile)
    pool.attach_tangram(profile, int(kvc.server_args.tangram_page_size), budget, full)
    return pool


def support_triton(original, backend: str) -> bool:
    """AROUND ``sglang.srt.utils.common.support_triton``: Triton helpers only off the CPU engine.

    SGLang decides by backend NAME whether its ``req_to_token`` writers may use Triton
    (``torch_native``/``intel_amx`` may not); ``tangram`` runs on CPU too.
    """
    if backend != "tangram":
        return original(backend)
    from sglang.srt.utils.common import is_cpu

    return not is_cpu()


def release_row(req_to_token_pool: Any, req: Any) -> None:
    """BEFORE ``ReqToTokenPool.free``: give the request row's pages back (finish/abort/retract)."""
    state = getattr(req_to_token_pool, "tangram_state", None)
    if state is not None and req.req_pool_idx is not None:
        state.release(int(req.req_pool_idx))


def record_host_batch(forward_batch: Any, batch: Any, model_runner: Any) -> None:
    """AFTER ``ForwardBatch.init_new``: hand the backend the batch's rows on the host.

    ``ScheduleBatch.req_pool_indices_cpu`` / ``seq_lens_cpu`` are the scheduler's own host
    copies; the attention backend plans from them instead of reading ``req_pool_indices`` back
    from the GPU (a sync per batch that would stop overlap scheduling). The record is read by
    the forward that follows (also through a CUDA-graph replay, which hands the backend a view
    without the schedule batch).
    """
    del forward_batch  # the record lives on the state: graph replays pass a different view
    state = getattr(getattr(model_runner, "token_to_kv_pool", None), "tangram_state", None)
    if state is None:
        return
    nodes = None
    if batch.forward_mode.is_extend():
        nodes = {
            int(req.req_pool_idx): req.last_node
            for req in batch.reqs
            if req.req_pool_idx is not None and getattr(req, "last_node", None) is not None
        }
    state.set_host_batch(
        getattr(batch, "req_pool_indices_cpu", None), getattr(batch, "seq_lens_cpu", None), nodes
    )


def state_of(scheduler: Any) -> Any:
    """The scheduler's TangramState, or None (no --tangram, or not built yet)."""
    worker = getattr(scheduler, "tp_worker", None)
    runner = getattr(worker, "model_runner", None)
    return getattr(getattr(runner, "token_to_kv_pool", None), "tangram_state", None)


def pool_info_of(scheduler: Any) -> dict[str, Any] | None:
    """Live pool numbers of a scheduler's Tangram state, or None without one."""
    state = state_of(scheduler)
    return None if state is None else state.pool_info()


def refuse_too_large(original: Any, scheduler: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``Scheduler.init_req_max_new_tokens``: HTTP 400 for a request larger than the pool.

    SGLang first resolves (and caps to its token pool) ``max_new_tokens``; the pages are counted
    for that value, the message names what the client asked. The request is aborted (HTTP 400,
    the server stays up) when its footprint exceeds the whole pool.
    """
    asked = req.sampling_params.max_new_tokens
    result = original(scheduler, req, *args, **kwargs)
    state = state_of(scheduler)
    if state is None or req.to_finish is not None:
        return result
    message = state.too_large(
        len(req.origin_input_ids), int(req.sampling_params.max_new_tokens or 0), asked
    )
    if message is not None:
        req.set_finish_with_abort(message)
    return result


def _extend_len(req: Any) -> int:
    """Tokens the request still prefills (SGLang's candidate extend length)."""
    return len(req.full_untruncated_fill_ids) - len(req.prefix_indices)


def _decode_tail(req: Any) -> int:
    """Decode-tail tokens the request may still write: ``T - 1`` minus what it already has."""
    left = int(req.sampling_params.max_new_tokens or 0) - len(req.output_ids)
    return decode_tail_tokens(left)


def plan_rows(req_to_token_pool: Any, reqs: list[Any]) -> None:
    """AFTER ``ReqToTokenPool.alloc``: record each NEW row's Budget Reservation inputs.

    Rows continuing a chunked prefill (their pages are reserved) are skipped. A retracted
    request gets a new row and re-plans: prompt = input + output so far, tail = what is left.
    """
    state = getattr(req_to_token_pool, "tangram_state", None)
    if state is None:
        return
    for req in reqs:
        row = req.req_pool_idx
        if row is not None and state.memory.rids[int(row)] is None:
            prompt = len(req.origin_input_ids) + len(req.output_ids)
            state.plan_row(int(row), prompt, _decode_tail(req))


def _reservation_request(adder: Any, req: Any, picked: bool) -> tuple[int, int, int]:
    """``(prompt tokens left, first chunk, decode tail)`` as :meth:`TangramState.begin_extend`
    will reserve them: SGLang gives a new request ``min(left, rem_chunk_tokens)`` tokens."""
    left = _extend_len(req)
    if picked:
        first = req.extend_range.length
    else:
        budget = getattr(adder, "rem_chunk_tokens", None)
        first = left if budget is None else max(min(left, int(budget)), 1)
    return left, first, _decode_tail(req)


def add_one_req(original, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``PrefillAdder.add_one_req``: admit only when the whole reservation fits (pages).

    Budget Reservation (docs/design.md §3.1): a request's footprint (this chunk, the prompt's later
    chunks uncompressed, the ``T - 1`` decode tail), plus those of the new requests already
    picked this round, must fit in the unreserved free pages plus the pages of unlocked radix
    nodes (evicted by the backend when it allocates; the request's own matched path is not
    counted). Running requests hold their grants (not unreserved), so an admitted request never
    waits for a page later and is never retracted for pages. Returns ``AddReqResult.NO_TOKEN``
    (the request waits) when it does not fit; otherwise SGLang's own checks run.
    """
    state = getattr(getattr(adder.tree_cache, "req_to_token_pool", None), "tangram_state", None)
    if state is None:
        return original(adder, req, *args, **kwargs)
    picked = [
        r for r in adder.can_run_list
        if r.req_pool_idx is None or state.memory.rids[int(r.req_pool_idx)] is None
    ]  # fmt: skip
    wanted = [_reservation_request(adder, r, True) for r in picked]
    wanted.append(_reservation_request(adder, req, False))
    num_prefixed = sum(1 for r in [*picked, req] if len(r.prefix_indices) > 0)
    evictable = state.evictable_pages(getattr(req, "last_node", None))
    if not state.can_admit_prefills(wanted, num_prefixed, evictable):
        from sglang.srt.managers.schedule_policy import AddReqResult

        return AddReqResult.NO_TOKEN
    return original(adder, req, *args, **kwargs)


def check_decode_mem(original, batch: Any, *args: Any, **kwargs: Any) -> bool:
    """AROUND ``ScheduleBatch.check_decode_mem``: the next decode step must fit in pages too.

    False makes SGLang retract requests (``retract_decode``), whose rows are freed through
    ``ReqToTokenPool.free``, i.e. their pages come back before the next check.
    """
    ok = original(batch, *args, **kwargs)
    state = getattr(batch.req_to_token_pool, "tangram_state", None)
    if not ok or state is None:
        return ok
    selected = kwargs.get("selected_indices", args[0] if args else None)
    reqs = batch.reqs if selected is None else [batch.reqs[i] for i in selected]
    rows = [int(r.req_pool_idx) for r in reqs if r.req_pool_idx is not None]
    if state.can_decode(rows):
        return True
    state.make_room_for_decode(rows)  # evict unlocked radix nodes before retracting anyone
    if state.can_decode(rows):
        return True
    state.num_page_retractions += 1  # Budget Reservation makes this 0 (tested end to end)
    return False
