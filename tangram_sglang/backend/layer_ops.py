"""Per-layer Tangram operations shared by the SGLang backend and the offline benchmarks.

No sglang import: the attention backend (``attention_backend.py``) and ``bench.prefill_profile``
call the same code, so what the profiler times is what the server runs.

* :class:`ReferenceKernels` (CPU, :mod:`tangram_sglang.kernels.reference`) and
  :class:`TritonKernels` (CUDA: Triton extend, kept-KV write, split-KV ragged decode with the
  split fitted to the real lengths and a chunk floor from the whole batch, the default
  ``TANGRAM_DECODE_PLAN=batch``; ``lengths`` and the static AOT table ``table`` by name),
  picked by :func:`kernels_for`;
* :func:`extend_layer`: one layer of an extend batch (extend attention over compressed history +
  causal new tokens, scorer + per-head top-``k_g``, kept-KV write).

Source: Tangram arXiv 2606.06302 (Budget Reservation, Ragged Paging, AOT load balancing);
docs/contracts.md (kernel calling conventions).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from tangram_sglang.backend import metadata as md
from tangram_sglang.backend.compress import batch_kept_indices
from tangram_sglang.backend.replay import replay_token_scores
from tangram_sglang.backend.state import TangramState
from tangram_sglang.config import (
    decode_ctas_per_sm,
    decode_plan,
    history_attention,
    prefill_attention,
)
from tangram_sglang.errors import ConfigError, KernelError
from tangram_sglang.kernels import reference
from tangram_sglang.kernels._checks import CheckedLayouts, check_tensor
from tangram_sglang.kernels.history_attention import (
    PAGED_HISTORY_MIN_WORK,
    PagedHistoryPlan,
    plan_paged_history,
)
from tangram_sglang.kernels.new_token_attention import check_finite, flashinfer_fallback
from tangram_sglang.kernels.split_table import CTAS_PER_SM, check_launch_ctas

logger = logging.getLogger(__name__)
NOMINAL_SMS = 132  # SMs of an H100 / H200: the CPU reference's nominal launch size


class ReferenceKernels:
    """CPU path: :mod:`tangram_sglang.kernels.reference` (also the tests' oracle).

    Args:
        history: :func:`config.history_attention`'s value. ``"triton"`` and ``"auto"`` (the
            default: no speed to gain from the split on this device) run every extend in the
            fused reference. ``"flashinfer"`` runs extend batches
            that carry a paged-history plan split, the history part through FlashInfer's
            paged-prefill semantics in torch (``kernels.history_attention.TorchPagedHistory``)
            on the same plan a GPU server gives FlashInfer: a CPU server then checks that plan
            end to end (no speed-up). Every batch with history and one length per
            (request, KV head) on every layer gets a plan (no work floor: nothing to amortise).
        plan: :func:`config.decode_plan`'s value. The reference decode has no split; under
            ``"batch"`` the backend still computes each step's chunk floors and :meth:`decode`
            checks that every layer receives its own.
        ctas_per_sm: :func:`config.decode_ctas_per_sm`'s value (sets :attr:`launch_ctas` on
            :data:`NOMINAL_SMS`).
    """

    paged_history_min_work = 0  # history work per layer under which no plan is built

    def __init__(
        self, history: str = "auto", plan: str = "batch", ctas_per_sm: int = CTAS_PER_SM
    ) -> None:
        from tangram_sglang.kernels.history_attention import TorchPagedHistory
        from tangram_sglang.kernels.new_token_attention import TorchNewTokens

        self.plan = plan
        # CTAs one decode launch aims for (the batch plan's floor denominator): nominal on CPU
        # (an H100's SMs), where the reference decode only checks that each layer receives its
        # floor
        check_launch_ctas(ctas_per_sm)  # a KernelError now, not at the first decode
        self.launch_ctas = int(ctas_per_sm) * NOMINAL_SMS
        self.split = (TorchNewTokens(), TorchPagedHistory()) if history == "flashinfer" else None
        self._planned = None  # the extend plan (metadata) the split was last planned for
        self._history_planned = False  # the paged history is planned for self._planned
        runs = (
            "the paged-history plans run through FlashInfer's semantics in torch"
            if self.split is not None
            else "every extend runs in the fused torch reference"
        )
        logger.info(
            "Tangram: history %s (TANGRAM_HISTORY_ATTENTION): %s on this device", history, runs
        )

    @property
    def plans_paged_history(self) -> bool:
        """Whether extend batches should carry a paged-history plan
        (``kernels.history_attention.plan_paged_history``)."""
        return self.split is not None

    @property
    def history_planned(self) -> bool:
        """Whether the last extend batch ran its history part through the paged history (its
        plan built and accepted; False after a fallback to the fused kernel)."""
        return self._history_planned

    def extend(
        self,
        q,
        k,
        v,
        qo_indptr,
        k_pool,
        v_pool,
        page_table,
        group_len,
        rows,
        goh,
        coh,
        sm_scale,
        max_extend_len,
        meta=None,
        layer=None,
    ):
        """``(out [T, H_q, D], lse float32 [T, H_q])`` of one extend layer: the fused
        reference, or, for a batch with a paged-history plan (``meta.history``) under
        ``history="flashinfer"``, the new tokens' reference merged with layer ``layer``'s paged
        history by LSE."""

        def fused():
            return reference.extend_reference(
                q, k, v, qo_indptr, k_pool, v_pool, page_table, group_len, rows, goh, coh, sm_scale
            )

        if self.split is None or meta is None or meta.history is None:
            return fused()
        from tangram_sglang.kernels.new_token_attention import split_extend

        new_tokens, history = self.split
        if self._planned is not meta:
            if self._planned is None:
                logger.info("Tangram: first extend batch with a paged-history plan")
            new_tokens.plan(meta.bounds, q.shape[1], k.shape[1], q.shape[2], q.dtype)
            self._history_planned = _plan_history(history, meta, q, k_pool, sm_scale)
            self._planned = meta
        if history.sm_scale != sm_scale:  # a layer scaled unlike the planned one
            return fused()
        _check_layer(layer)
        return split_extend(
            new_tokens, lambda: history.run(q, k_pool, v_pool, layer), q, k, v, sm_scale
        )

    def kv_write(self, *args) -> None:
        """Kept-KV write (arguments of ``kernels.kv_write.write_kept_kv``)."""
        reference.kv_write_reference(*args)

    def decode_write(self, k_pool, v_pool, k, v, meta, goh, coh) -> None:
        """The new token's K/V ``[bs, H_kv, D]`` into its group slots (``meta``: decode plan)."""
        md.write_decode_token(k_pool, v_pool, k, v, meta, goh, coh)

    def decode(
        self,
        q,
        k_pool,
        v_pool,
        page_table,
        group_len,
        rows,
        goh,
        coh,
        sm_scale,
        lid,
        out=None,
        chunk_floor=None,
    ):
        """``[bs, H_q, D]`` ragged decode of one layer. No split plan here; under the ``batch``
        plan ``chunk_floor`` (the layer's floor) is checked to be an int32 ``[1]`` tensor, so a
        CPU server checks the floors' wiring that a GPU server's kernel reads.

        Raises:
            KernelError: ``plan="batch"`` and ``chunk_floor`` missing or of another shape/dtype.
        """
        if self.plan == "batch":
            if chunk_floor is None:
                raise KernelError(
                    f"decode of layer {lid} under TANGRAM_DECODE_PLAN=batch got no chunk floor "
                    "(the decode plan carries one per layer: metadata.decode_chunk_floors)"
                )
            check_tensor("chunk_floor", chunk_floor, (1,), (torch.int32,), q.device)
        return reference.decode_reference(
            q, k_pool, v_pool, page_table, group_len, rows, goh, coh, sm_scale
        )


class TritonKernels(ReferenceKernels):
    """CUDA path: the Triton extend, kv-write and split-KV ragged decode kernels.

    Split tables (per bucket: the CTA budget, and the static AOT map) and the decode scratch are
    built once here (start-up); decode writes into the caller's static ``out`` (no allocation
    per step, CUDA-graph safe).

    Args:
        state: the server's TangramState (profile: grouping, group ratios, model shape).
        max_batch_size: largest decode batch (requests; SGLang's request rows).
        device: a CUDA device.
        plan: the decode split plan, ``"batch"`` (default: fitted to each row's kept lengths
            in the kernel, with a chunk floor from the whole batch that the backend computes on
            the host each step), ``"lengths"`` (fitted to the row alone) or ``"table"`` (the
            static AOT table); :func:`config.decode_plan`.
        prefill: who computes an extend's attention (:func:`config.prefill_attention`):
            ``"triton"`` (Tangram's extend kernel), ``"flashinfer"`` (the new tokens through
            FlashInfer, every batch) or ``"auto"`` (split where it pays, ``metadata.split_pays``;
            Tangram's kernel everywhere for a pool dtype FlashInfer does not run, without the
            flashinfer package, without room for its workspace or when its start-up run fails,
            logged). FlashInfer's prefill runs once here on a one-token batch
            (:func:`warm_up_new_tokens`), so a JIT build happens at start-up.
        history: who computes the history part (:func:`config.history_attention`):
            ``"triton"`` (Tangram's kernel), ``"flashinfer"`` (FlashInfer's paged prefill in
            batches with a paged-history plan, ``kernels.history_attention``; Tangram's kernel
            where FlashInfer cannot run, with a warning) or ``"auto"`` (the same; a missing
            package, a float32 pool or no room for it logged at info level, a failed start-up
            run or plan still a warning). Either needs the new tokens through FlashInfer
            (``prefill`` not ``"triton"``, and FlashInfer usable).
        ctas_per_sm: CTAs per SM one decode launch aims for (:func:`config.decode_ctas_per_sm`;
            the split tables' CTA budgets and the batch plan's ``launch_ctas``).

    Raises:
        ConfigError: ``prefill="flashinfer"`` with a float32 pool.
        KernelError: ``prefill="flashinfer"`` without the flashinfer package, or FlashInfer's
            start-up run fails.
        torch.OutOfMemoryError: ``prefill="flashinfer"`` and no room for its workspace.
    """

    # history work per layer under which no plan is built: FlashInfer's plan and the split's
    # extra launches per layer must pay (kernels.history_attention.PAGED_HISTORY_MIN_WORK)
    paged_history_min_work = PAGED_HISTORY_MIN_WORK

    def __init__(
        self,
        state: TangramState,
        max_batch_size: int,
        device: torch.device,
        plan: str = "batch",
        prefill: str = "triton",
        history: str = "auto",
        ctas_per_sm: int = CTAS_PER_SM,
    ) -> None:
        from tangram_sglang.kernels import build_log
        from tangram_sglang.kernels.decode_attention import decode_scratch
        from tangram_sglang.kernels.split_table import build_split_tables

        build_log.install()  # a line per Triton build of a Tangram kernel, start-up or serving
        profile = state.profile
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.tables = build_split_tables(
            profile.grouping, profile.group_ratios, num_sms, max_batch_size, ctas_per_sm=ctas_per_sm
        ).to(device)
        m = profile.model
        self.plan = plan
        self.launch_ctas = self.tables.tables[0].launch_ctas  # the same in every bucket
        logger.info(
            "Tangram decode: plan %s, %d CTAs per SM (TANGRAM_DECODE_CTAS_PER_SM), %d CTAs per "
            "launch on %d SMs",
            plan,
            ctas_per_sm,
            self.launch_ctas,
            num_sms,
        )
        # per bucket, every layer's view, built once: decode only indexes them
        self.views = {
            t.batch_size: [t.layer(lid) for lid in range(m.num_layers)] for t in self.tables.tables
        }
        self.mid_o, self.mid_lse = decode_scratch(
            max_batch_size, m.num_qo_heads, self.tables.scratch_splits, m.head_dim, device
        )
        # argument layouts the extend and kv-write launchers checked: an extend batch's first
        # layer is checked, its later layers (same layouts) are not checked again
        self.extend_layouts, self.kv_write_layouts = CheckedLayouts(), CheckedLayouts()
        self.new_tokens = None
        self._planned = None  # the extend plan (metadata) new_tokens was last planned for
        self.prefill = prefill
        self.history = None  # FlashInferPagedHistory under history="flashinfer"
        self._history_planned = False  # the paged history is planned for self._planned
        self._history_logged = False
        if prefill in ("auto", "flashinfer"):
            from tangram_sglang.kernels.new_token_attention import FlashInferNewTokens

            dtype = state.memory.kv_pool.k_pool.dtype
            try:
                self.new_tokens = FlashInferNewTokens(device, dtype)
                if not warm_up_new_tokens(self.new_tokens, m, dtype, device):
                    raise KernelError(
                        f"TANGRAM_PREFILL_ATTENTION={prefill}: FlashInfer's prefill failed its "
                        "start-up run (the warning above says why); use "
                        "TANGRAM_PREFILL_ATTENTION=triton, or auto, which then keeps Tangram's "
                        "kernel"
                    )
            except (ConfigError, KernelError, torch.OutOfMemoryError) as exc:
                # float32, no flashinfer package, no room left for FlashInfer's workspace, or
                # a FlashInfer that cannot build or run this configuration
                if prefill == "flashinfer":
                    raise
                logger.info("Tangram: TANGRAM_PREFILL_ATTENTION=auto without FlashInfer (%s)", exc)
                self.new_tokens, self.prefill = None, "triton"
        if history in ("auto", "flashinfer") and self.new_tokens is not None:
            from tangram_sglang.kernels.history_attention import FlashInferPagedHistory

            try:
                # the new tokens' workspace: both wrappers run on one stream, one after the other
                self.history = FlashInferPagedHistory(
                    self.new_tokens.workspace,
                    state.memory.kv_pool.k_pool.dtype,
                )
                self.history.warm_up(m.num_qo_heads, m.num_kv_heads, m.head_dim)
            except (ConfigError, KernelError, torch.OutOfMemoryError) as exc:
                # asked for by name: a warning; the default: info
                logger.log(
                    logging.WARNING if history == "flashinfer" else logging.INFO,
                    "Tangram: TANGRAM_HISTORY_ATTENTION=%s without FlashInfer's paged prefill "
                    "(%s); the history part stays in Tangram's kernel",
                    history,
                    exc,
                )
                self.history = None
        elif history == "flashinfer":
            # the new tokens' FlashInfer is off (the line above says why), and the paged history
            # shares its workspace and its split
            logger.warning(
                "Tangram: TANGRAM_HISTORY_ATTENTION=flashinfer without FlashInfer's new-token "
                "prefill; the history part stays in Tangram's kernel"
            )
        logger.info(
            "Tangram: extend attention %s (TANGRAM_PREFILL_ATTENTION), history %s "
            "(TANGRAM_HISTORY_ATTENTION)",
            self.prefill,
            "flashinfer where planned" if self.plans_paged_history else "triton",
        )

    @property
    def plans_paged_history(self) -> bool:
        """Whether extend batches should carry a paged-history plan
        (``kernels.history_attention.plan_paged_history``)."""
        return self.history is not None and self.history.usable

    def extend(
        self,
        q,
        k,
        v,
        qo_indptr,
        k_pool,
        v_pool,
        page_table,
        group_len,
        rows,
        goh,
        coh,
        sm_scale,
        max_extend_len,
        meta=None,
        layer=None,
    ):
        """``(out, lse)`` from ``kernels.extend_attention.ragged_extend_attention``, or, under
        ``prefill="flashinfer"`` (or ``"auto"`` and ``meta.split_new_tokens``, or a batch with a
        paged-history plan ``meta.history``) with the batch's plan ``meta``, the new tokens
        through FlashInfer (planned on the batch's first layer) and the history only when
        ``meta.any_history`` (``kernels.new_token_attention.split_extend``): through
        FlashInfer's paged prefill for layer ``layer`` where the batch has a paged-history
        plan, else through Tangram's kernel."""
        from tangram_sglang.kernels.extend_attention import ragged_extend_attention
        from tangram_sglang.kernels.new_token_attention import split_extend

        def fused(new_tokens: bool = True):
            out = torch.empty_like(q)
            lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
            return ragged_extend_attention(
                q,
                k,
                v,
                qo_indptr,
                k_pool,
                v_pool,
                page_table,
                group_len,
                rows,
                goh,
                coh,
                sm_scale,
                out,
                lse,
                max_extend_len,
                new_tokens=new_tokens,
                checked=self.extend_layouts,
            )

        if self.new_tokens is None or meta is None:
            return fused()
        paged = self.history is not None and meta.history is not None
        if self.prefill == "auto" and not meta.split_new_tokens and not paged:
            return fused()
        if self._planned is not meta:
            self.new_tokens.plan(meta.bounds, q.shape[1], k.shape[1], q.shape[2], q.dtype)
            if paged and not self._history_logged:
                logger.info("Tangram: first extend batch with a paged-history plan")
                self._history_logged = True
            self._history_planned = paged and _plan_history(self.history, meta, q, k_pool, sm_scale)
            self._planned = meta
        history = None
        if self._history_planned and sm_scale == self.history.sm_scale:
            _check_layer(layer)
            history = lambda: self.history.run(q, k_pool, v_pool, layer)  # noqa: E731
        elif meta.any_history:
            history = lambda: fused(new_tokens=False)  # noqa: E731
        return split_extend(self.new_tokens, history, q, k, v, sm_scale)

    def kv_write(self, *args) -> None:
        """``kernels.kv_write.write_kept_kv`` (one launch per layer; each argument layout
        checked once)."""
        from tangram_sglang.kernels.kv_write import write_kept_kv

        write_kept_kv(*args, checked=self.kv_write_layouts)

    def decode_write(self, k_pool, v_pool, k, v, meta, goh, coh) -> None:
        """``kernels.decode_kv_write.write_decode_kv``: one launch per layer, strided K/V."""
        from tangram_sglang.kernels.decode_kv_write import write_decode_kv

        write_decode_kv(k, v, k_pool, v_pool, meta.dest_page, meta.dest_slot, goh, coh)

    def decode(
        self,
        q,
        k_pool,
        v_pool,
        page_table,
        group_len,
        rows,
        goh,
        coh,
        sm_scale,
        lid,
        out=None,
        chunk_floor=None,
    ):
        """Split-KV ragged decode of layer ``lid`` (this server's plan, the bucket's table;
        ``chunk_floor``: the layer's int32 [1] floor under the ``batch`` plan)."""
        from tangram_sglang.kernels.decode_attention import ragged_decode_attention

        table = self.views[self.tables.for_batch(q.shape[0]).batch_size][lid]
        out = torch.empty_like(q) if out is None else out
        return ragged_decode_attention(
            q,
            k_pool,
            v_pool,
            page_table,
            group_len,
            rows,
            goh,
            coh,
            table,
            sm_scale,
            out,
            self.mid_o,
            self.mid_lse,
            plan=self.plan,
            chunk_floor=chunk_floor,
        )


def warm_up_new_tokens(new_tokens, model, dtype: torch.dtype, device: torch.device) -> bool:
    """One planned run of the new-token attention on a one-token batch at start-up, so that a
    JIT-compiled FlashInfer builds the new tokens' ragged prefill module of this dtype and
    head_dim (FA3 on Hopper; the paged history's FA2 module is built by
    ``kernels.history_attention.FlashInferPagedHistory.warm_up``) before the server takes
    traffic rather than inside the first long prompt's forward, as stock SGLang's own warm-up
    request does for its FlashInfer backend. Its inputs come from a seeded CPU generator, so the
    device's generator (sampling) is left as SGLang seeded it.

    Args:
        new_tokens: a ``kernels.new_token_attention`` new-token attention (``plan`` / ``run``).
        model: the profile's model shape (``num_qo_heads``, ``num_kv_heads``, ``head_dim``).
        dtype: the pool's dtype; device: the server's device.

    Returns:
        True when the run finished with a finite output; False (the exception logged as a
        warning) when it raised or its output was not finite: the caller then keeps Tangram's
        kernels, so a FlashInfer that cannot build or run this configuration fails here, not in
        a forward.
    """
    h_q, h_kv, d = model.num_qo_heads, model.num_kv_heads, model.head_dim
    start = time.perf_counter()
    try:
        gen = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = (torch.randn(1, h, d, generator=gen).to(device, dtype) for h in (h_q, h_kv, h_kv))
        new_tokens.plan([0, 1], h_q, h_kv, d, dtype)
        check_finite(new_tokens.run(q, k, v, d**-0.5)[0])
    except torch.OutOfMemoryError:
        raise  # a full device is not this path's to hide
    except Exception as exc:  # e.g. a FlashInfer build that cannot compile this configuration
        flashinfer_fallback(
            "prefill failed its start-up run", exc, "extend attention stays in Tangram's kernel"
        )
        return False
    logger.info(
        "Tangram: FlashInfer's prefill ready in %.1f s (built or loaded at start-up)",
        time.perf_counter() - start,
    )
    return True


def _plan_history(history, meta: md.TangramForwardMetadata, q, k_pool, sm_scale: float) -> bool:
    """``history.plan`` (a ``kernels.history_attention`` paged history) for the batch of
    ``meta``, with the model's shapes from ``q [T, H_q, D]`` and the pool's page size and dtype;
    its result (whether the batch runs it)."""
    return history.plan(
        meta.history,
        meta.history_ids,
        q.shape[1],
        q.shape[2],
        k_pool.shape[2],
        k_pool.dtype,
        sm_scale,
    )


def _check_layer(layer: int | None) -> None:
    """A batch with a paged-history plan reads each layer's own page ids: the layer is needed.

    Raises:
        KernelError: ``layer`` is None.
    """
    if layer is None:
        raise KernelError(
            "extend with a paged-history plan needs the layer index (kernels.extend(..., "
            "layer=layer_id)): each layer reads its own heads' pages"
        )


def kernels_for(device: torch.device, state: TangramState, max_batch_size: int) -> ReferenceKernels:
    """Triton kernels on CUDA, the torch reference elsewhere (start-up).

    Reads ``TANGRAM_DECODE_PLAN``, ``TANGRAM_DECODE_CTAS_PER_SM``, ``TANGRAM_PREFILL_ATTENTION``
    and ``TANGRAM_HISTORY_ATTENTION`` once (:func:`config.decode_plan`,
    :func:`config.decode_ctas_per_sm`, :func:`config.prefill_attention`,
    :func:`config.history_attention`; checked on every device).

    Raises:
        ConfigError: a bad value of any of them.
    """
    plan, prefill, history = decode_plan(), prefill_attention(), history_attention()
    ctas_per_sm = decode_ctas_per_sm()
    if device.type == "cuda":
        return TritonKernels(
            state, max_batch_size, device, plan, prefill, history, ctas_per_sm=ctas_per_sm
        )
    return ReferenceKernels(history, plan, ctas_per_sm)


def batch_history_plan(
    kernels: ReferenceKernels,
    state: TangramState,
    rows: list[int] | np.ndarray,
    extend_lens: list[int],
    start_lens: np.ndarray,
) -> PagedHistoryPlan | None:
    """The extend batch's paged-history plan when ``kernels`` run one (host work, at plan time).

    ``kernels.history_attention.plan_paged_history`` with the server's profile and page size,
    and the kernels' work floor; None when the kernels take no plan or the batch gets none.

    Args:
        kernels: :func:`kernels_for`'s kernels.
        state: the server's TangramState.
        rows: ``bs`` page-table rows; extend_lens: ``bs`` tokens each request runs (its
            queries: the segment, plus its replay tokens under a replay scorer).
        start_lens: int ``[bs, G]`` kept lengths before the segments (the scheduler's plan).

    Raises:
        KernelError: a history longer than the page table holds (an invariant broken upstream).
    """
    if not kernels.plans_paged_history:
        return None
    grouping, model = state.profile.grouping, state.profile.model
    plan = plan_paged_history(
        rows,
        np.concatenate([[0], np.cumsum(extend_lens, dtype=np.int64)]).tolist(),
        start_lens,
        grouping.cluster_of,
        grouping.column_of,
        grouping.heads_per_group,
        state.memory.table.page_size,
        model.num_qo_heads,
        model.head_dim,
        min_work=kernels.paged_history_min_work,
    )
    width = state.memory.table.max_pages_per_group
    if plan is not None and int(plan.num_pages.max()) > width:
        raise KernelError(
            f"paged history: a history of {int(plan.num_pages.max())} pages exceeds the page "
            f"table's {width} per group (kept lengths past the table: a memory-manager bug)"
        )
    return plan


def extend_layer(
    kernels: ReferenceKernels,
    state: TangramState,
    meta: md.TangramForwardMetadata,
    q3: torch.Tensor,
    k3: torch.Tensor,
    v3: torch.Tensor,
    layer_id: int,
    sm_scale: float,
) -> torch.Tensor:
    """One layer of an extend batch: attention, per-head top-``k_g``, kept-KV write.

    Args:
        kernels: :func:`kernels_for`'s kernels.
        state: the server's TangramState (pool, tables, scorer, layer maps).
        meta: the batch's extend plan (``metadata.extend_metadata``).
        q3: ``[T, H_q, D]``; k3, v3: ``[T, H_kv, D]`` post-RoPE, contiguous, the pool's dtype.
        layer_id: layer index (its group/column maps and group ratios).
        sm_scale: softmax scale.

    Returns:
        ``[T, H_q, D]`` attention output. The pool holds the kept K/V of this layer afterwards.
        History lengths come from ``meta.hist_len`` (the lengths before the segment: the
        scheduler advanced the live ``group_len`` when it allocated the batch) or, without it,
        from the live ``group_len``.
    """
    memory = state.memory
    table = memory.table
    goh, coh = state.group_of_head[layer_id], state.column_of_head[layer_id]
    hist = table.group_len if meta.hist_len is None else meta.hist_len  # lengths before
    replay = meta.replay
    if replay is not None:  # each row's segment, then its replay (backend.replay)
        q3, k3, v3 = (x.index_select(0, replay.to_logical) for x in (q3, k3, v3))
    out, lse = kernels.extend(
        q3,
        k3,
        v3,
        meta.qo_indptr,
        memory.kv_pool.k_pool,
        memory.kv_pool.v_pool,
        table.page_table,
        hist,
        meta.req_rows,
        goh,
        coh,
        sm_scale,
        meta.max_extend_len,
        meta=meta,
        layer=layer_id,
    )
    profile = state.profile
    kept_host, kept_dev = meta.layer_kept(layer_id, profile.grouping.cluster_of[layer_id])
    bounds, indptr, token_scores = meta.bounds, meta.qo_indptr, None
    if replay is not None:  # score the segments by their replay; keep segment tokens only
        token_scores = replay_token_scores(state.scorer, q3, k3, lse, replay, sm_scale)
        segment = replay.segment_tokens
        q3, k3, v3, lse = (x.index_select(0, segment) for x in (q3, k3, v3, lse))
        bounds, indptr = replay.segment_bounds, replay.segment_indptr
    kept_idx = batch_kept_indices(
        state.scorer,
        q3,
        k3,
        lse,
        bounds,
        kept_host,
        sm_scale,
        profile.sink_tokens,
        profile.recent_window,
        kept_dev,
        v_new=v3,
        layer_id=layer_id,
        token_scores=token_scores,
    )
    kernels.kv_write(
        k3,
        v3,
        indptr,
        kept_idx,
        meta.kept_count,
        memory.kv_pool.k_pool,
        memory.kv_pool.v_pool,
        table.page_table,
        hist,
        meta.req_rows,
        goh,
        coh,
    )
    return out if replay is None else out.index_select(0, replay.to_flat)
