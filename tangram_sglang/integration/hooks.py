"""Thin hook bodies registered by the plugin (one per row of ``hook_targets.HOOKS``).

Each body does nothing unless the server runs with ``--tangram`` and delegates the work to the
module that owns it. Signatures follow SGLang's ``HookRegistry`` (``hook_registry._wrap_fn``):
BEFORE ``fn(*args, **kwargs) -> (args, kwargs) | None``, AFTER ``fn(result, *args, **kwargs) ->
new_result | None``, AROUND ``fn(original_fn, *args, **kwargs)``.
"""

from __future__ import annotations

from typing import Any

from tangram_sglang.integration import edge_checks, sglang_adapters
from tangram_sglang.integration.server_args import (
    require_compressing_backend,
    summary_from_server_args,
)


def add_tangram_init_info(result: dict[str, Any], scheduler: Any) -> dict[str, Any] | None:
    """AFTER ``Scheduler.get_init_info``: add key ``tangram`` (the start-up summary).

    Runs once per scheduler process at start-up. The scheduler sends this dict to the HTTP
    server, which merges it into ``/server_info`` (``http_server.server_info``). The pool's
    numbers at start-up go under ``tangram.pool_at_start`` (``sglang_adapters.pool_info_of``;
    a snapshot: the live numbers are each scheduler's ``tangram_pool``, see
    :func:`add_tangram_pool_state`).

    Returns:
        The dict with ``tangram`` added, or None (unchanged) without ``--tangram``.

    Raises:
        ConfigError: no ``tangram`` attention backend in this build (the scheduler, and with it
            the server, stops instead of serving uncompressed KV under ``--tangram``).
    """
    if not getattr(scheduler.server_args, "tangram", False):
        return None
    require_compressing_backend()
    result["tangram"] = summary_from_server_args(scheduler.server_args)
    pool = sglang_adapters.pool_info_of(scheduler)
    if pool is not None:
        result["tangram"]["pool_at_start"] = pool
    return result


def add_tangram_pool_state(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``Scheduler.get_internal_state``: live pool numbers under key ``tangram_pool``.

    ``/server_info`` lists each scheduler's internal state (``internal_states[0]``), fresh per
    call: pages total/used/free, bytes held vs full KV of the live tokens, last released row.
    """
    pool = sglang_adapters.pool_info_of(scheduler)
    if pool is not None:  # result: GetInternalStateReqOutput, mutated in place
        result.internal_state["tangram_pool"] = pool


def tangram_cell_size(original: Any, *args: Any, **kwargs: Any) -> int:
    """AROUND ``DefaultPoolConfigurator._compute_cell_size``: see ``sglang_adapters``."""
    return sglang_adapters.compute_cell_size(original, *args, **kwargs)


def tangram_kv_pool(original: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``KVCacheConfigurator._build_mha_kv_pool``: see ``sglang_adapters``."""
    return sglang_adapters.build_mha_kv_pool(original, *args, **kwargs)


def release_tangram_row(*args: Any, **kwargs: Any) -> None:
    """BEFORE ``ReqToTokenPool.free(self, req)``: release the row's pages (returns None)."""
    sglang_adapters.release_row(*args, **kwargs)


def defer_tangram_finishes(original: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``Scheduler.process_batch_result``: see ``sglang_adapters.defer_finishes``."""
    return sglang_adapters.defer_finishes(original, *args, **kwargs)


def plan_tangram_rows(
    result: Any, req_to_token_pool: Any, reqs: Any, *args: Any, **kw: Any
) -> None:
    """AFTER ``ReqToTokenPool.alloc(self, reqs)``: Budget Reservation inputs of each new row."""
    if result is not None:
        sglang_adapters.plan_rows(req_to_token_pool, reqs)


def allocate_tangram_extend(result: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``allocation.alloc_for_extend(batch)``: the batch's pages (returns None).

    See ``sglang_adapters.allocate_extend``.
    """
    sglang_adapters.allocate_extend(result, batch)


def add_tangram_replay(result: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``ScheduleBatch.prepare_for_extend(self)``: a replay scorer's replay tokens.

    See ``sglang_adapters.add_replay``.
    """
    sglang_adapters.add_replay(batch)


def allocate_tangram_decode(result: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``allocation.alloc_for_decode(batch, token_per_req)``: the step's pages.

    See ``sglang_adapters.allocate_decode``.
    """
    token_per_req = kwargs.get("token_per_req", args[0] if args else 1)
    sglang_adapters.allocate_decode(batch, int(token_per_req))


def tangram_support_triton(original: Any, *args: Any, **kwargs: Any) -> bool:
    """AROUND ``sglang.srt.utils.common.support_triton``: see ``sglang_adapters``."""
    return sglang_adapters.support_triton(original, *args, **kwargs)


def refuse_too_large_request(original: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``Scheduler.init_req_max_new_tokens``: abort a request larger than the pool."""
    return sglang_adapters.refuse_too_large(original, *args, **kwargs)


def tangram_add_one_req(original: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``PrefillAdder.add_one_req``: see ``sglang_adapters.add_one_req``."""
    return sglang_adapters.add_one_req(original, *args, **kwargs)


def tangram_align_chunked_req(result: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``PrefillAdder.add_chunked_req``: see ``sglang_adapters.align_chunked_req``."""
    sglang_adapters.align_chunked_req(result, *args, **kwargs)


def tangram_check_decode_mem(original: Any, *args: Any, **kwargs: Any) -> bool:
    """AROUND ``ScheduleBatch.check_decode_mem``: see ``sglang_adapters.check_decode_mem``."""
    return sglang_adapters.check_decode_mem(original, *args, **kwargs)


def tangram_answer_refused_on_queue(original: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``Scheduler._add_request_to_queue``: see ``sglang_adapters``."""
    return sglang_adapters.answer_refused_on_queue(original, *args, **kwargs)


def tangram_answer_refused_in_admission(result: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``Scheduler._get_new_batch_prefill_raw``: see ``sglang_adapters``."""
    sglang_adapters.answer_refused_in_admission(result, *args, **kwargs)


def tangram_check_request(result: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``TokenizerManager._validate_one_request``: see ``edge_checks.check_request``."""
    edge_checks.check_request(*args, **kwargs)


def record_tangram_host_batch(
    result: Any, cls: Any, batch: Any, model_runner: Any = None, *args: Any, **kwargs: Any
) -> None:
    """AFTER ``ForwardBatch.init_new(cls, batch, model_runner)``: rows on the host (returns None).

    See ``sglang_adapters.record_host_batch``.
    """
    runner = model_runner if model_runner is not None else kwargs.get("model_runner")
    sglang_adapters.record_host_batch(result, batch, runner)
