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
* the scheduler owns the pages: when SGLang allocates a batch's token slots
  (``allocation.alloc_for_extend`` / ``alloc_for_decode``, in ``ScheduleBatch.prepare_for_*``,
  before the batch runs, under both event loops) :func:`allocate_extend` / :func:`allocate_decode`
  allocate its pages and advance its group lengths through the one scheduler-side manager
  (:class:`~tangram_sglang.backend.state.TangramState`); the attention backend only reads them.
* freeing a request row (``ReqToTokenPool.free``: finish, abort, retraction all go through it)
  releases the row's pages.
* admission counts pages (``docs/admission.md``; the formula is
  :meth:`~tangram_sglang.backend.state.TangramState.request_pages`): on arrival a request the
  pool can never hold is refused (:func:`refuse_too_large`, answered at once by
  :func:`answer_refused_on_queue`) or, without ``max_tokens``, gets a T that fits;
  :func:`add_one_req` admits a prefill only when its pages fit next to the running requests'
  decode headroom, and refuses what can never be admitted (answered by
  :func:`answer_refused_in_admission`); :func:`check_decode_mem` makes SGLang retract when the
  pool runs dry, as stock does.

Source: integration/README.md §4 (pool construction and sizing, recommended route).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from sglang.srt.mem_cache.memory_pool import NoOpMHATokenToKVPool

from tangram_sglang.backend.replay import replay_positions
from tangram_sglang.backend.state import PrefillAsk
from tangram_sglang.errors import ConfigError
from tangram_sglang.host_copy import host_to_device
from tangram_sglang.integration import profile_loader, replay
from tangram_sglang.integration.server_args import rank_profile_from_server_args
from tangram_sglang.mem.kv_pool import KVPool, bytes_per_page, num_pages_for_budget
from tangram_sglang.mem.reservation import admission_decode_tokens
from tangram_sglang.profile import BudgetProfile
from tangram_sglang.radix.cache import value_of

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
        self.mem_usage = (
            self.tangram_kv_pool.num_pages * self.tangram_kv_pool.bytes_per_page / (1 << 30)
        )
        logger.info(
            "Tangram KV pool: %d pages x %d bytes = %.3f GB (H_p=%d, page_size=%d, D=%d) for %d "
            "logical token slots; SGLang's full-size token K/V buffers not allocated",
            num_pages,
            self.tangram_kv_pool.bytes_per_page,
            self.mem_usage,
            h_p,
            page_size,
            dim,
            self.size,
        )

    def get_kv_size_bytes(self):
        """K and V bytes of the Tangram page pool (what SGLang reports as the KV cache)."""
        half = self.tangram_kv_pool.k_pool.numel() * self.tangram_kv_pool.k_pool.element_size()
        return half, half


def compute_cell_size(original, configurator: Any, kvc: Any, num_layers: int) -> int:
    """AROUND ``DefaultPoolConfigurator._compute_cell_size``: the Tangram cell under --tangram."""
    full = original(configurator, kvc, num_layers)
    if not tangram_on(kvc.server_args):
        return full
    cell = tangram_cell_bytes(full, rank_profile_from_server_args(kvc.server_args))
    logger.info("Tangram: %d bytes per logical token (full KV %d)", cell, full)
    return cell


def build_mha_kv_pool(original, kvc: Any, **kwargs: Any) -> Any:
    """AROUND ``KVCacheConfigurator._build_mha_kv_pool``: the Tangram pool under --tangram."""
    if not tangram_on(kvc.server_args):
        return original(kvc, **kwargs)
    kwargs["mha_pool_class"] = TangramTokenToKVPool
    pool = original(kvc, **kwargs)
    profile = rank_profile_from_server_args(kvc.server_args)  # this TP rank's heads
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


def defer_finishes(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``Scheduler.process_batch_result``: the step's finished requests are inserted
    into the tree when the step ends, after it has streamed its outputs
    (``TangramRadixCache.deferred_finishes``).

    Returns:
        What the original returns. A scheduler whose tree is not Tangram's runs it as is.
    """
    scope = getattr(getattr(scheduler, "tree_cache", None), "deferred_finishes", None)
    if scope is None:
        return original(scheduler, *args, **kwargs)
    with scope():
        return original(scheduler, *args, **kwargs)


def _tangram_state(batch: Any) -> Any:
    return getattr(getattr(batch, "req_to_token_pool", None), "tangram_state", None)


def allocate_extend(result: Any, batch: Any) -> None:
    """AFTER ``alloc_for_extend(batch)``: allocate the extend batch's pages (schedule time).

    ``result`` is ``(out_cache_loc, req_pool_indices_device, req_pool_indices_cpu)``; the rows
    come from the host copy, the segment and prefix lengths from ``batch.extend_lens`` /
    ``batch.prefix_lens`` (set by ``prepare_for_extend`` just before), each new row's matched
    radix node from ``req.last_node``. Admission (:func:`add_one_req`) reserved the pages with
    the same formula (:meth:`TangramState.request_pages`), so this never waits.
    """
    state = _tangram_state(batch)
    if state is None:
        return
    rows = result[2]
    nodes = {
        int(row): req.last_node
        for req, row in zip(batch.reqs, rows.tolist(), strict=True)
        if getattr(req, "last_node", None) is not None
    }
    state.allocate_extend(rows.numpy(), batch.extend_lens, batch.prefix_lens, nodes)


def add_replay(batch: Any) -> None:
    """AFTER ``ScheduleBatch.prepare_for_extend``: under a replay scorer, each compressed
    row's replay tokens go in front of its segment (``integration.replay``)."""
    state = _tangram_state(batch)
    if state is not None:
        replay.add_replay_tokens(batch, state)


def allocate_decode(batch: Any, token_per_req: int) -> None:
    """AFTER ``alloc_for_decode(batch, token_per_req)``: one decode token's pages per row.

    Runs in ``prepare_for_decode`` right after ``update_running_batch``'s decode check
    (:func:`check_decode_mem`: a page shortfall retracts requests there), before
    ``seq_lens_cpu`` is advanced; rows and lengths are the batch's host copies.

    Raises:
        ConfigError: more than one token per request (speculative decoding: not supported).
    """
    state = _tangram_state(batch)
    if state is None:
        return
    if token_per_req != 1:
        raise ConfigError(
            f"Tangram allocates one decode token per request per step, SGLang asked for "
            f"{token_per_req}; speculative decoding is not supported with --tangram"
        )
    rows = batch.req_pool_indices_cpu.numpy()
    state.allocate_decode(rows, batch.seq_lens_cpu.numpy() + token_per_req)


def record_host_batch(forward_batch: Any, batch: Any, model_runner: Any) -> None:
    """AFTER ``ForwardBatch.init_new``: hand the backend the batch's rows on the host.

    ``ScheduleBatch.req_pool_indices_cpu`` / ``seq_lens_cpu`` are the scheduler's own host
    copies; the attention backend plans from them instead of reading ``req_pool_indices`` back
    from the GPU (a sync per batch that would stop overlap scheduling). The record is read by
    the forward that follows (also through a CUDA-graph replay, which hands the backend a view
    without the schedule batch).
    """
    state = getattr(getattr(model_runner, "token_to_kv_pool", None), "tangram_state", None)
    if state is None:
        return
    replay_lens = getattr(batch, replay.REPLAY_ATTR, None)
    mode = forward_batch.forward_mode
    if replay_lens is not None and not (mode.is_extend() and not mode.is_mixed()):
        replay_lens = None  # a stale record on a batch that now decodes
    state.set_host_batch(
        getattr(batch, "req_pool_indices_cpu", None),
        getattr(batch, "seq_lens_cpu", None),
        replay_lens,
    )
    if replay_lens is not None:  # replay tokens first in the row, at positions after it
        positions = replay_positions(
            batch.prefix_lens, batch.extend_lens, replay_lens, state.replay_max_positions
        )
        forward_batch.positions = host_to_device(positions, forward_batch.positions.device)


def state_of(scheduler: Any) -> Any:
    """The scheduler's TangramState, or None (no --tangram, or not built yet)."""
    worker = getattr(scheduler, "tp_worker", None)
    runner = getattr(worker, "model_runner", None)
    return getattr(getattr(runner, "token_to_kv_pool", None), "tangram_state", None)


def pool_info_of(scheduler: Any) -> dict[str, Any] | None:
    """Live pool numbers of a scheduler's Tangram state, or None without one."""
    state = state_of(scheduler)
    return None if state is None else state.pool_info()


def _clip() -> int:
    """SGLang's cap on the decode tail its admission counts (tokens, 4096 by default)."""
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

    return int(CLIP_MAX_NEW_TOKENS)


REFUSAL_ATTR = "_tangram_refusal"  # Req attribute: the HTTP 400 text of a refused request
ASKED_ATTR = "_tangram_asked"  # Req attribute: max_new_tokens as the client sent it (None: unset)
ROUND_ATTR = "_tangram_round"  # PrefillAdder attribute: its RoundPicks


def _first_chunk(state: Any, prompt_tokens: int) -> int:
    """The first chunk of a prompt on an otherwise empty round (SGLang's chunked prefill)."""
    chunk = int(state.chunk_tokens)
    return prompt_tokens if chunk <= 0 else min(prompt_tokens, chunk)


def refuse_too_large(original: Any, scheduler: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``Scheduler.init_req_max_new_tokens``: the whole-pool check on arrival.

    SGLang first resolves (and caps to its token pool) ``max_new_tokens`` = T. The request is
    priced with :meth:`TangramState.fits_pool` (prompt + the whole ``T``-token tail, empty pool):

    * fits: nothing changes;
    * the client set no ``max_new_tokens`` (OpenAI ``max_tokens`` unset): T is lowered to the
      largest value that fits the pool (as SGLang caps it to its token pool), logged;
    * otherwise (or the prompt alone does not fit): the request is refused; its HTTP 400 (naming
      ``max_tokens`` and the pool size) is sent by :func:`answer_refused_on_queue` at once.
    """
    asked = req.sampling_params.max_new_tokens
    result = original(scheduler, req, *args, **kwargs)
    state = state_of(scheduler)
    if state is None or req.to_finish is not None:
        return result
    setattr(req, ASKED_ATTR, asked)
    prompt = len(req.origin_input_ids)
    max_new = int(req.sampling_params.max_new_tokens or 0)
    ask = PrefillAsk(prompt, _first_chunk(state, prompt), max(max_new, 0))
    if state.fits_pool(ask):
        return result
    best = state.max_decode_tokens(ask)
    if asked is None and best >= 1:
        _cap_max_new_tokens(req, best + len(req.output_ids), state.pool_pages)
        return result
    message = state.never_fits_message(ask, max_new, asked)
    setattr(req, REFUSAL_ATTR, message)
    req.set_finish_with_abort(message)  # if it ever reaches admission: a 1-token abort
    return result


def _cap_max_new_tokens(req: Any, max_new_tokens: int, pool_pages: int) -> None:
    logger.info(
        "Tangram: request %s sets no max_new_tokens; capped to %d so that it fits the %d-page "
        "KV pool",
        req.rid,
        max_new_tokens,
        pool_pages,
    )
    req.sampling_params.max_new_tokens = int(max_new_tokens)
    if req.sampling_params.min_new_tokens > req.sampling_params.max_new_tokens:
        req.sampling_params.min_new_tokens = req.sampling_params.max_new_tokens


def _send_refusal(scheduler: Any, req: Any, message: str, log: bool = True) -> None:
    """Answer a queued-or-arriving request with HTTP 400 now (it holds no pages, no row)."""
    from http import HTTPStatus

    from sglang.srt.managers.io_struct import AbortReq
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    reason = FINISH_ABORT(message, HTTPStatus.BAD_REQUEST, "BadRequestError").to_json()
    scheduler.ipc_channels.send_to_tokenizer.send_output(
        AbortReq(finished_reason=reason, rid=req.rid), req
    )
    if log:
        logger.warning("%s (request %s)", message, req.rid)


def answer_refused_on_queue(original: Any, scheduler: Any, req: Any, *args: Any, **kw: Any) -> Any:
    """AROUND ``Scheduler._add_request_to_queue``: a refused request is answered, not queued.

    :func:`refuse_too_large` marks a request that can never fit; it gets its HTTP 400 here, the
    moment it would enter the waiting queue, and never takes a page or a scheduling round.
    """
    message = getattr(req, REFUSAL_ATTR, None)
    if message is None or state_of(scheduler) is None:
        return original(scheduler, req, *args, **kw)
    _send_refusal(scheduler, req, message, log=False)  # set_finish_with_abort logged it
    return None


def answer_refused_in_admission(result: Any, scheduler: Any, *args: Any, **kw: Any) -> None:
    """AFTER ``Scheduler._get_new_batch_prefill_raw``: answer what admission refused this round.

    :func:`add_one_req` cannot touch the scheduler's queue; it parks each request it refuses
    on the state (``state.refused``). Here each one leaves the waiting queue and gets its 400.
    """
    state = state_of(scheduler)
    if state is None or not state.refused:
        return
    refused, state.refused = state.refused, []
    gone = {id(req) for req, _ in refused}
    scheduler.waiting_queue = [r for r in scheduler.waiting_queue if id(r) not in gone]
    for req, message in refused:
        _send_refusal(scheduler, req, message)


def _extend_len(req: Any) -> int:
    """Tokens the request still prefills (SGLang's candidate extend length)."""
    return len(req.full_untruncated_fill_ids) - len(req.prefix_indices)


def _tokens_left(req: Any) -> int:
    """Tokens the request may still generate (``max_new_tokens - len(output_ids)``); 0 when it
    is already aborted (it prefills one token and ends). For a running request this is also the
    decode tokens it will still write (its last sampled token is written at the next step)."""
    if req.to_finish is not None:
        return 0
    return max(int(req.sampling_params.max_new_tokens or 0) - len(req.output_ids), 0)


def _new_tail(req: Any) -> int:
    """Decode tokens a request not yet prefilled may write to KV: ``T - out`` (its prompt holds
    its output so far). Without overlap scheduling the last sampled token is never written
    (``T - 1 - out``); with it (SGLang's default) a finished request runs one more decode step
    that writes it, so admission counts ``T - out``: one token of slack without overlap."""
    return _tokens_left(req)


def plan_rows(req_to_token_pool: Any, reqs: list[Any]) -> None:
    """AFTER ``ReqToTokenPool.alloc``: record each NEW row's prompt (what admission reserves).

    Rows continuing a chunked prefill (their pages are reserved) are skipped. A retracted
    request gets a new row and re-plans: prompt = input + output so far. The decode tail is not
    reserved (it grows by pages: ``backend.state``). A row whose finished request the tree
    has not inserted yet (``TangramRadixCache.deferred_finishes``) is inserted first, so the
    new request starts on a clean row.
    """
    state = getattr(req_to_token_pool, "tangram_state", None)
    if state is None:
        return
    if state.radix is not None:
        state.radix.flush_finishes()
    for req in reqs:
        row = req.req_pool_idx
        if row is not None and state.memory.rids[int(row)] is None:
            prompt = len(req.origin_input_ids) + len(req.output_ids)
            state.plan_row(int(row), prompt, 0)


def _ask(state: Any, req: Any, first_chunk: int, decode_tokens: int) -> PrefillAsk:
    """The request as admission prices it: prompt left, first chunk, tail, matched prefix."""
    node = getattr(req, "last_node", None)
    value = None if node is None else value_of(node)
    cached = len(req.prefix_indices)
    lens = None if value is None or cached == 0 else value.group_lens
    pinned = state.radix.path_pages(node) if state.radix is not None and lens is not None else 0
    left = _extend_len(req)
    first = max(min(int(first_chunk), left), min(left, 1))
    return PrefillAsk(left, first, decode_tokens, lens, pinned, cached)


@dataclass(slots=True)
class RoundPicks:
    """What one ``PrefillAdder`` round has picked so far, priced once per request.

    ``PrefillAdder`` only appends to ``can_run_list`` while it fills a round (a new adder is
    made each round), so each picked request is priced when it first shows up there, and a
    later candidate reads the running sums. A round of ``n`` candidates prices ``3n`` times
    (whole-pool check, fits-now check, pick), not ``n + n(n+1)/2`` (every candidate re-pricing
    every pick: 2,144 prices for 64).
    """

    priced: int = 0  # entries of can_run_list already counted
    new_requests: int = 0  # picked requests that start a new row
    new_pages: int = 0  # sum of their TangramState.request_pages
    continuing: list[Any] = field(default_factory=list)  # rows continuing a chunked prefill
    running_headroom: int | None = None  # the running batch's tail pages (computed once)


def round_picks(state: Any, adder: Any) -> RoundPicks:
    """The adder's :class:`RoundPicks`, brought up to date with its ``can_run_list``.

    A picked request whose row already holds pages continues a chunked prefill (its pages are
    reserved): it is listed in ``continuing``. Any other is priced by
    :meth:`TangramState.request_pages` with its chosen chunk (``extend_range``) and
    ``min(T - out, clip)`` decode tokens, as when it was admitted.
    """
    picks = getattr(adder, ROUND_ATTR, None)
    if picks is None:
        picks = RoundPicks()
        setattr(adder, ROUND_ATTR, picks)
    for r in adder.can_run_list[picks.priced :]:
        if r.req_pool_idx is not None and state.memory.rids[int(r.req_pool_idx)] is not None:
            picks.continuing.append(r)
        else:
            tail = admission_decode_tokens(_new_tail(r), _clip())
            picks.new_pages += state.request_pages(_ask(state, r, r.extend_range.length, tail))
            picks.new_requests += 1
    picks.priced = len(adder.can_run_list)
    return picks


def _running_headroom(state: Any, adder: Any, picks: RoundPicks) -> int:
    """Pages the running requests' remaining tails need, x SGLang's ``new_token_ratio``.

    Computed once per ``PrefillAdder`` for its running batch (the batch does not change while
    the adder fills a round); rows continuing a chunked prefill are added per call.
    """
    ratio = float(adder.new_token_ratio)
    if picks.running_headroom is None:
        reqs = [r for r in getattr(adder.running_batch, "reqs", []) if r.req_pool_idx is not None]
        picks.running_headroom = state.decode_headroom_pages(
            [int(r.req_pool_idx) for r in reqs],
            [admission_decode_tokens(_tokens_left(r), _clip(), ratio) for r in reqs],
        )
    chunked = state.decode_headroom_pages(
        [int(r.req_pool_idx) for r in picks.continuing],
        [admission_decode_tokens(_new_tail(r), _clip(), ratio) for r in picks.continuing],
    )
    return picks.running_headroom + chunked


def add_one_req(original, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``PrefillAdder.add_one_req``: admit only when the pages fit (``docs/admission.md``).

    1. Whole pool (:meth:`TangramState.fits_pool`, with the request's matched prefix path): a
       request that could not run to ``max_new_tokens`` even alone is refused (HTTP 400), or
       when the client set no ``max_new_tokens`` its T is lowered to what fits.
    2. Now (:meth:`TangramState.can_admit`): the new requests of this round at
       ``min(T - out, clip)`` tail tokens each, plus the running requests' remaining tails x
       ``new_token_ratio``, within unreserved free + evictable pages (the request's own prefix
       path excluded). Otherwise ``AddReqResult.NO_TOKEN``: the request waits in the queue.
    3. An idle pool (no row holds pages) on which it does not fit now: it never will; refused
       (HTTP 400) instead of a NO_TOKEN that nothing would ever clear.

    Refused requests return ``AddReqResult.OTHER`` (this round ends; nothing is marked full)
    and are answered by :func:`answer_refused_in_admission`. Then SGLang's own checks run.

    Under grid segmentation (``TangramState.segment_grid`` > 0) SGLang's
    ``truncation_align_size`` is set to the grid, so a truncated chunk ends on an absolute
    multiple of it (the matched prefix already does: the tree holds whole grid cells only).
    """
    state = getattr(getattr(adder.tree_cache, "req_to_token_pool", None), "tangram_state", None)
    if state is not None:
        args, kwargs = _align_to_grid(int(getattr(state, "segment_grid", 0)), args, kwargs)
    if state is None or getattr(req, REFUSAL_ATTR, None) is not None:
        return original(adder, req, *args, **kwargs)
    from sglang.srt.managers.schedule_policy import AddReqResult

    whole = _ask(state, req, _first_chunk(state, _extend_len(req)), _new_tail(req))
    if req.to_finish is None and not state.fits_pool(whole):
        asked = getattr(req, ASKED_ATTR, req.sampling_params.max_new_tokens)
        best = state.max_decode_tokens(whole)
        if asked is None and best >= 1:
            _cap_max_new_tokens(req, best + len(req.output_ids), state.pool_pages)
        else:
            max_new = int(req.sampling_params.max_new_tokens or 0)
            return _refuse(state, req, state.never_fits_message(whole, max_new, asked))
    picks = round_picks(state, adder)
    budget = getattr(adder, "rem_chunk_tokens", None)
    left = _extend_len(req)
    first = left if budget is None else max(min(left, int(budget)), 1)
    grid = int(getattr(state, "segment_grid", 0))
    if grid and first < left:  # SGLang cuts the chunk down to a grid multiple (or skips it)
        first = max(first // grid * grid, 1)
    tail = admission_decode_tokens(_new_tail(req), _clip())
    new = [_ask(state, req, first, tail)]
    evictable = state.evictable_pages(getattr(req, "last_node", None))
    headroom = _running_headroom(state, adder, picks) + picks.new_pages
    if state.can_admit(new, headroom, evictable):
        return original(adder, req, *args, **kwargs)
    if state.is_idle() and picks.new_requests == 0:
        cached, asked = len(req.prefix_indices), req.sampling_params.max_new_tokens
        offer = state.memory.ledger.unreserved_free() + evictable
        message = (
            f"Tangram: request needs {state.admission_need(new)} KV pages ({left} prompt tokens "
            f"to prefill, {cached} cached, max_tokens {asked}) but the idle "
            f"{state.pool_pages}-page pool has {offer} to give; lower max_tokens "
            "(max_new_tokens) or start a new conversation, or give the server more KV memory"
        )
        return _refuse(state, req, message)
    return AddReqResult.NO_TOKEN


def grid_chunk_end(start: int, end: int, full: int, grid: int) -> int:
    """End (tokens) of a continuing chunk ``[start, end)`` of a ``full``-token prompt, on the grid.

    SGLang cuts a continuing chunk short when its token pool is nearly full
    (``PrefillAdder.add_chunked_req`` ignores ``truncation_align_size``). Under grid segmentation
    (``grid`` > 0) the cut moves down to the last multiple of ``grid`` past ``start``, so the
    chunk stays a whole grid cell and the row keeps caching its cells. Unchanged when the chunk
    reaches the prompt's end, the grid is off, or less than one cell fits (the chunk must still
    make progress: that row then stops caching cells, as a cold server would not cut there).
    """
    if grid <= 0 or end >= full:
        return end
    aligned = end // grid * grid
    return aligned if aligned > start else end


def align_chunked_req(result: Any, adder: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``PrefillAdder.add_chunked_req``: a truncated continuing chunk ends on the grid.

    The adder's budgets stay charged for the longer cut (conservative for this round).
    See :func:`grid_chunk_end`.
    """
    state = getattr(getattr(adder.tree_cache, "req_to_token_pool", None), "tangram_state", None)
    grid = int(getattr(state, "segment_grid", 0)) if state is not None else 0
    if not grid:
        return
    span = req.extend_range
    end = grid_chunk_end(span.start, span.end, len(req.full_untruncated_fill_ids), grid)
    if end != span.end:
        req.set_extend_range(span.start, end)


def _align_to_grid(grid: int, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``add_one_req``'s ``(has_chunked_req, truncation_align_size)`` with the grid as the
    truncation alignment (tokens; the least common multiple with SGLang's own, if it set one)."""
    if grid <= 0:
        return args, kwargs
    if "truncation_align_size" in kwargs:
        own = kwargs["truncation_align_size"]
        return args, {**kwargs, "truncation_align_size": math.lcm(grid, own or grid)}
    if len(args) >= 2:
        return (args[0], math.lcm(grid, args[1] or grid), *args[2:]), kwargs
    return args, {**kwargs, "truncation_align_size": grid}


def _refuse(state: Any, req: Any, message: str) -> Any:
    from sglang.srt.managers.schedule_policy import AddReqResult

    state.refused.append((req, message))
    return AddReqResult.OTHER


def _decode_rows(batch: Any, selected: Any) -> Any:
    """The request rows of a decode batch (``selected_indices`` into ``batch.reqs``, or all),
    from the batch's host copy ``req_pool_indices_cpu`` when it matches ``batch.reqs``."""
    host = getattr(batch, "req_pool_indices_cpu", None)
    if host is not None and len(host) == len(batch.reqs):
        rows = host.numpy()
        return rows if selected is None else rows[list(selected)]
    reqs = batch.reqs if selected is None else [batch.reqs[i] for i in selected]
    return [int(r.req_pool_idx) for r in reqs if r.req_pool_idx is not None]


def check_decode_mem(original, batch: Any, *args: Any, **kwargs: Any) -> bool:
    """AROUND ``ScheduleBatch.check_decode_mem``: the next decode step must fit in pages too.

    The decode tail is not reserved (it grows by pages), so when the pool runs dry this says
    False and SGLang retracts requests (``retract_decode``) as stock does; their rows are freed
    through ``ReqToTokenPool.free``, i.e. their pages come back before the next check. Unlocked
    radix nodes are evicted first.
    """
    ok = original(batch, *args, **kwargs)
    state = getattr(batch.req_to_token_pool, "tangram_state", None)
    if not ok or state is None:
        return ok
    selected = kwargs.get("selected_indices", args[0] if args else None)
    rows = _decode_rows(batch, selected)
    if state.can_decode(rows):
        return True
    state.make_room_for_decode(rows)  # evict unlocked radix nodes before retracting anyone
    if state.can_decode(rows):
        return True
    state.num_page_retractions += 1  # the pool ran dry: SGLang retracts, as stock does
    return False
