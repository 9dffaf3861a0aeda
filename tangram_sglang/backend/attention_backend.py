"""TangramAttnBackend: SGLang's ``tangram`` attention backend over the compressed, ragged pool.

The backend is a pure reader of page tables (FlashInfer-style plan/run). The scheduler owns the
pages: :class:`~tangram_sglang.backend.state.TangramState` allocates them when SGLang schedules
the batch (``alloc_for_extend`` / ``alloc_for_decode`` hooks, ``integration``) and advances each
head group's kept length there. Plan per batch (``init_forward_metadata``: run the deferred
copy-on-write copies, flush the page-table deltas and build :mod:`metadata` once, in one packed
upload; no allocation, no commit, no ``PoolError``), run per layer:

* ``forward_extend``: the new tokens attend to the row's compressed history pages + the causal
  new tokens (K/V of the new tokens stay transient, never in the pool); the profile's scorer
  scores the observation window (normalised by the extend ``lse``: history + new); every KV head
  keeps its own top ``k_g`` (``k_g = kept_len(n, group ratio)``); only the kept K/V are written
  into the allocated pages. The history lengths come from the plan (the lengths before the
  segment), since the live lengths already include ``k_g``.
* ``forward_decode``: the new token's K/V go into its slot of every group, then ragged decode.

Positions are SGLang's logical positions (RoPE is applied to q/k by the model before this
backend sees them), so K is cached after RoPE. GQA: query heads ``h*gqa ... (h+1)*gqa-1`` read
KV head h. CPU runs :mod:`tangram_sglang.kernels.reference`; CUDA runs the Triton kernels.

CUDA graphs (decode only; SGLang 0.5.17's ``DecodeCudaGraphRunner``): ``init_cuda_graph_state``
checks the static decode buffers (:class:`~tangram_sglang.backend.metadata.DecodeGraphBuffers`,
built at start-up and also used by eager decode on CUDA); ``init_forward_metadata_out_graph``
runs on the host before capture/replay (the plan written in place into the buffers, padded
entries -> row 0 / page 0); ``init_forward_metadata_in_graph`` has nothing
to record. Prefill stays eager (``--tangram`` sets ``--disable-prefill-cuda-graph``). Ran on the
H200 with graphs for batch sizes 1-128 (benchmarks/RESULTS.md, issue 7).

Importing this module registers the backend as ``"tangram"`` in SGLang's attention registry and
its ``--attention-backend`` choices (the plugin's ``REGISTRATIONS`` row imports it).

Source: Tangram arXiv 2606.06302 (Budget Reservation, Ragged Paging, AOT load balancing);
docs/contracts.md; SGLang ``TorchNativeAttnBackend`` (template).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch
from sglang.srt.layers.attention.attention_registry import register_attention_backend
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.server_args import add_attention_backend_choices

from tangram_sglang.backend import metadata as md
from tangram_sglang.backend.layer_ops import batch_history_plan, extend_layer, kernels_for
from tangram_sglang.backend.replay import check_every_compressed_row_replays, replay_layout
from tangram_sglang.backend.state import TangramState
from tangram_sglang.errors import ConfigError, KernelError
from tangram_sglang.mem.manager import TangramMemory
from tangram_sglang.scoring.kvzip import ReplayPrompts, needs_replay
from tangram_sglang.scoring.kvzip_gate import is_token_scorer
from tangram_sglang.scoring.replay import RopeShift, bind_rope, check_rope_span, needs_rope

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

BACKEND_NAME = "tangram"


def tangram_state_of(model_runner: ModelRunner) -> TangramState:
    """The runner's TangramState, built once from the Tangram KV pool (start-up).

    The state is stored on the pool (one per server) and on the ``ReqToTokenPool`` (whose
    ``free`` hook releases a row's pages).

    Raises:
        ConfigError: the runner's KV pool is not Tangram's (server started without --tangram).
    """
    pool = model_runner.token_to_kv_pool
    kv_pool = getattr(pool, "tangram_kv_pool", None)
    if kv_pool is None:
        raise ConfigError(
            f"--attention-backend {BACKEND_NAME} reads Tangram's compressed KV pool, but the KV "
            f"pool is {type(pool).__name__}; start the server with --tangram"
        )
    if pool.tangram_state is None:
        req_pool = model_runner.req_to_token_pool
        max_context = int(req_pool.req_to_token.shape[1])
        memory = TangramMemory(
            pool.tangram_profile,
            kv_pool.page_size,
            kv_pool.num_pages,
            max_rows=int(req_pool.req_to_token.shape[0]),
            max_pages_per_group=math.ceil(max_context / kv_pool.page_size),
            kv_pool=kv_pool,
            device=kv_pool.k_pool.device,
        )
        chunk = model_runner.server_args.chunked_prefill_size or 0
        state = TangramState(memory, pool.full_kv_bytes_per_token, model_runner.device, chunk)
        if needs_rope(state.scorer):
            state.scorer = bind_rope(state.scorer, model_rope(model_runner.model))
        if is_token_scorer(state.scorer):
            check_gate_rope(model_runner.model)
        if needs_replay(state.scorer):
            state.replay_prompts = ReplayPrompts.from_tokenizer(_tokenizer(model_runner))
            tables = [int(cache.shape[0]) for _, _, cache in _rotary_modules(model_runner.model)]
            state.replay_max_positions = min(tables) if tables else None
        pool.tangram_state = state
        req_pool.tangram_state = state
    return pool.tangram_state


def _tokenizer(model_runner: ModelRunner):
    """The server's tokenizer (None under ``--skip-tokenizer-init``), with the arguments SGLang's
    scheduler passes (``Scheduler.init_tokenizer``); the model's own chat template."""
    args = model_runner.server_args
    if getattr(args, "skip_tokenizer_init", False):
        return None
    from sglang.srt.utils.hf_transformers.tokenizer import get_tokenizer

    return get_tokenizer(
        args.tokenizer_path or args.model_path,
        tokenizer_mode=args.tokenizer_mode,
        trust_remote_code=args.trust_remote_code,
        revision=getattr(args, "revision", None),
        tokenizer_backend=getattr(args, "tokenizer_backend", None) or "huggingface",
    )


def _rotary_modules(model: torch.nn.Module):
    """``(name, module, cos_sin_cache)`` of every rotary embedding of the language model
    (vision towers skipped)."""
    for name, module in model.named_modules():
        cache = getattr(module, "cos_sin_cache", None)
        if isinstance(cache, torch.Tensor) and "vision" not in name and "visual" not in name:
            yield name, module, cache


def model_rope(model: torch.nn.Module) -> RopeShift:
    """The served model's RoPE frequencies, from its attention layers' rotary embeddings.

    SGLang's rotary embeddings keep a ``cos_sin_cache`` (``[max_positions, rotary_dim]``, cos
    then sin) and ``is_neox_style``; position 1's row gives each frequency. A cache kept in
    half precision (SGLang casts it to the model dtype off CUDA) is recomputed in float32 with
    the module's own ``_compute_cos_sin_cache``. Vision towers are skipped.

    Raises:
        ConfigError: no rotary embedding, a layout other than one ``cos | sin`` block, or
            layers with different RoPE (e.g. local and global layers): kvzip-replay binds one.
    """
    found = []
    for name, module, cache in _rotary_modules(model):
        rotary_dim = int(getattr(module, "rotary_dim", cache.shape[-1]))
        if cache.dim() != 2 or cache.shape[0] < 2 or cache.shape[1] != rotary_dim:
            raise ConfigError(
                f"scorer kvzip-replay: {name} ({type(module).__name__}) has a cos_sin_cache of "
                f"shape {list(cache.shape)}, not [positions, rotary_dim={rotary_dim}]; serve "
                "this model with --tangram-scorer kvzip-lite"
            )
        if cache.dtype != torch.float32 and hasattr(module, "_compute_cos_sin_cache"):
            cache = module._compute_cos_sin_cache().float()
        rope = RopeShift.from_cos_sin_row(cache[1], getattr(module, "is_neox_style", True))
        check_rope_span(rope, int(getattr(module, "head_size", 2 * rope.inv_freq.numel())))
        found.append((name, rope))
    if not found:
        raise ConfigError(
            f"scorer kvzip-replay needs the model's RoPE, but {type(model).__name__} has no "
            "rotary embedding with a cos_sin_cache; serve it with --tangram-scorer kvzip-lite"
        )
    name0, rope = found[0]
    for name, other in found[1:]:
        same = other.neox == rope.neox and other.inv_freq.shape == rope.inv_freq.shape
        if not same or not torch.allclose(other.inv_freq, rope.inv_freq, rtol=1e-4, atol=1e-7):
            raise ConfigError(
                f"scorer kvzip-replay binds one RoPE, but {name0} and {name} use different "
                "ones (local and global layers?); serve this model with --tangram-scorer "
                "kvzip-lite"
            )
    return rope


def check_gate_rope(model: torch.nn.Module) -> None:
    """``kvzip-gate`` reads the norm of each rotary pair ``(k_i, k_{i + D/2})`` of post-RoPE
    keys, which RoPE leaves unchanged only in the neox layout over the whole head (Llama, Qwen2,
    SmolLM2). Elsewhere the gate's input would depend on the position.

    Raises:
        ConfigError: a rotary embedding (vision towers skipped) that is interleaved (GPT-J
            style) or rotates part of the head; names the module and the fix.
    """
    for name, module, cache in _rotary_modules(model):
        neox = bool(getattr(module, "is_neox_style", True))
        rotary_dim = int(getattr(module, "rotary_dim", cache.shape[-1]))
        head = int(getattr(module, "head_size", rotary_dim))
        if not neox or rotary_dim != head:
            raise ConfigError(
                f"scorer kvzip-gate reads rotary-pair norms of the keys, unchanged by RoPE only "
                f"in the neox layout over the whole head, but {name} ({type(module).__name__}) "
                f"has is_neox_style={neox}, rotary_dim={rotary_dim}, head_size={head}; serve "
                "this model with --tangram-scorer kvzip-lite"
            )


class TangramAttnBackend(AttentionBackend):
    """The ``tangram`` attention backend (one per model runner).

    Args:
        model_runner: SGLang's ``ModelRunner``; its ``token_to_kv_pool`` must be the Tangram pool
            (``integration.sglang_adapters.TangramTokenToKVPool``).

    Raises:
        ConfigError: the KV pool is not Tangram's.
    """

    def __init__(self, model_runner: ModelRunner) -> None:
        super().__init__()
        self.device = torch.device(model_runner.device)
        self.state = tangram_state_of(model_runner)
        self.memory = self.state.memory
        self.k_pool = self.memory.kv_pool.k_pool
        self.v_pool = self.memory.kv_pool.v_pool
        self.forward_metadata: md.TangramForwardMetadata | None = None
        self.kernels = kernels_for(
            self.device, self.state, int(model_runner.req_to_token_pool.size)
        )
        m = self.state.profile.model
        # Device writes of the page table and COW copies are staged when the scheduler
        # allocates, and applied once per batch plan, on the stream the batch runs on.
        self.memory.table.deferred = True
        self.memory.defer_copies = True
        # The lengths before each extend segment, at the batch's rows (metadata.hist_len).
        self.extend_hist_len = torch.zeros_like(self.memory.table.group_len)
        self.decode_buffers = md.DecodeGraphBuffers.create(
            self.memory.table.max_rows,
            self.memory.num_head_groups,
            m.num_qo_heads,
            m.head_dim,
            model_runner.dtype,
            self.device,  # attention output: the model's dtype (q's)
            num_layers=m.num_layers,
        )
        # TANGRAM_DECODE_PLAN=batch: each step's per-layer chunk floors come from host lengths
        # (on CPU too: the reference decode checks that every layer gets its floor)
        self._floor_plan = None
        if self.kernels.plan == "batch":
            self._floor_plan = (
                md.heads_per_group_of_layer(
                    self.state.profile.grouping.cluster_of, self.memory.num_head_groups
                ),
                self.kernels.launch_ctas,
            )

    def support_triton(self) -> bool:
        """Whether SGLang may run its Triton helpers (``req_to_token`` writes): CUDA only."""
        return self.device.type == "cuda"

    # ---- plan (per batch) ----------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Build the per-batch tensors from host data (once per batch); allocates nothing.

        The scheduler allocated the batch's pages and advanced its lengths
        (:meth:`TangramState.allocate_extend` / :meth:`~TangramState.allocate_decode`). Here:
        the deferred copy-on-write copies run, then the page-table deltas and the plan reach the
        device in one packed non-blocking copy (``PageTable.flush``). Host inputs only (rows
        from the schedule batch's CPU copies, :meth:`TangramState.host_batch_for`; extend
        lengths from the scheduler's plan): no device-to-host read.

        Raises:
            ConfigError: a mixed or other unsupported forward mode.
            KernelError: no host copy of the batch's rows, or no scheduler allocation for an
                extend row (the plugin's hooks did not run).
        """
        mode = forward_batch.forward_mode
        table = self.memory.table
        self.memory.run_copies()
        if mode.is_idle():
            table.flush()  # deltas of rows released or allocated since the last batch
            self.forward_metadata = None
            return
        rows, _ = self.state.host_batch_for(forward_batch, int(forward_batch.batch_size))
        if mode.is_decode():
            self.forward_metadata = self._plan_decode(rows)
        elif mode.is_extend() and not mode.is_mixed():
            extend_lens = list(forward_batch.extend_seq_lens_cpu)
            replay = self.state.host_replay_lens  # replay tokens before each segment
            layout, segment_lens = None, extend_lens
            if replay is not None:
                layout = replay_layout(extend_lens, replay, self.device)  # checks the lengths
                segment_lens = np.diff(layout.segment_bounds).tolist()
            start, kept = self.state.extend_plan_for(rows, segment_lens)
            if needs_replay(self.state.scorer):
                check_every_compressed_row_replays(segment_lens, kept, replay)
            history = batch_history_plan(self.kernels, self.state, rows, extend_lens, start)
            self.forward_metadata = md.extend_metadata(
                rows,
                extend_lens,
                kept,
                self.device,
                self.state.profile.grouping.cluster_of,
                upload=table.flush,
                start_lens=start,
                hist_len=self.extend_hist_len,
                history=history,
                page_table=table.page_table,
            )
            self.forward_metadata.replay = layout
        else:
            raise ConfigError(f"the {BACKEND_NAME} backend does not run forward mode {mode.name}")

    def _plan_decode(
        self, rows: np.ndarray, padded_bs: int | None = None
    ) -> md.TangramForwardMetadata:
        """The decode plan of ``rows`` (pages allocated by the scheduler), host work per step.

        CUDA: the plan is written into the static buffers (graph-safe, also used eagerly);
        CPU: fresh tensors for the reference kernels. Either way the page-table deltas and the
        plan go to the device in one packed copy.
        """
        table = self.memory.table
        ps = self.memory.page_size
        floor = None
        if self._floor_plan is not None:
            floor = md.decode_chunk_floors(table.lens, rows, *self._floor_plan)
        if self.device.type != "cuda":
            return md.decode_metadata(
                rows, table.pages, table.lens, ps, self.device, table.flush, floor
            )
        bs = rows.size if padded_bs is None else padded_bs
        return self.decode_buffers.fill(rows, bs, table.pages, table.lens, ps, table.flush, floor)

    # ---- CUDA graphs (decode) ------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Start-up: the static decode buffers must hold SGLang's largest captured batch.

        Raises:
            ConfigError: ``max_bs`` exceeds the request rows (the buffers' size).
        """
        if max_bs > self.decode_buffers.max_bs:
            raise ConfigError(
                f"CUDA graph max batch size {max_bs} exceeds the {self.decode_buffers.max_bs} "
                "request rows of the tangram backend; lower --cuda-graph-max-bs"
            )

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """Sequence length SGLang gives padded batch entries (their K/V go to page 0)."""
        return 1

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """Host planning before a decode graph is captured or replayed (SGLang calls it).

        Capture: every entry is padding (no request owns the rows).
        Replay: ``forward_batch`` is SGLang's padded view (``num_padding`` entries at the end);
        the plan of the real rows (pages allocated by the scheduler) is written into the static
        buffers after the deferred copy-on-write copies.

        Raises:
            ConfigError: a non-decode batch (prefill graphs are not supported: pass
                ``--disable-prefill-cuda-graph``).
        """
        mode = forward_batch.forward_mode
        if not mode.is_decode():
            raise ConfigError(
                f"the {BACKEND_NAME} backend captures CUDA graphs for decode only, got "
                f"{mode.name}; start the server with --disable-prefill-cuda-graph"
            )
        bs = int(forward_batch.batch_size)
        if in_capture:
            rows = np.zeros(0, np.int64)
        else:
            n = bs - int(getattr(forward_batch, "num_padding", 0) or 0)
            rows, _ = self.state.host_batch_for(forward_batch, n)
            self.memory.run_copies()
        self.forward_metadata = self._plan_decode(rows, bs)

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        """Nothing to record: the plan is already in the static buffers (out of graph)."""

    # ---- run (per layer) ----------------------------------------------------------------------
    def forward_extend(
        self,
        q,
        k,
        v,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs,
    ) -> torch.Tensor:
        """Attention of the new tokens over compressed history + causal new tokens; keep top-k_g.

        Args:
            q: ``[num_tokens, num_qo_heads * D]``; k, v: ``[num_tokens, H_kv * D]`` (post-RoPE).

        Returns:
            ``[num_tokens, num_qo_heads * D]``.
        """
        meta = self._meta(md.EXTEND, save_kv_cache)
        lid = layer.layer_id
        q3, k3, v3 = _split_heads(q, k, v, layer)
        out = extend_layer(self.kernels, self.state, meta, q3, k3, v3, lid, layer.scaling)
        return out.reshape(out.shape[0], -1)

    def forward_decode(
        self,
        q,
        k,
        v,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs,
    ) -> torch.Tensor:
        """Write the new token into its group slots, then ragged decode over the kept tokens.

        Args:
            q: ``[bs, num_qo_heads * D]``; k, v: ``[bs, H_kv * D]`` (post-RoPE).

        Returns:
            ``[bs, num_qo_heads * D]``.
        """
        meta = self._meta(md.DECODE, save_kv_cache)
        lid = layer.layer_id
        q3, k3, v3 = _split_heads(q, k, v, layer, contiguous=False)
        goh, coh = self.state.group_of_head[lid], self.state.column_of_head[lid]
        self.kernels.decode_write(self.k_pool, self.v_pool, k3, v3, meta, goh, coh)
        out = self.kernels.decode(
            q3,
            self.k_pool,
            self.v_pool,
            self.memory.table.page_table,
            self.memory.table.group_len,
            meta.req_rows,
            goh,
            coh,
            layer.scaling,
            lid,
            meta.out,
            chunk_floor=None if meta.chunk_floor is None else meta.chunk_floor[lid],
        )
        return out.reshape(out.shape[0], -1)

    def _meta(self, mode: str, save_kv_cache: bool) -> md.TangramForwardMetadata:
        meta = self.forward_metadata
        if meta is None or meta.mode != mode:
            raise KernelError(f"{BACKEND_NAME}: forward_{mode} without a {mode} plan for the batch")
        if not save_kv_cache:
            raise KernelError(
                f"{BACKEND_NAME}: save_kv_cache=False is not supported (the backend owns the "
                "kept-KV write); this model path writes K/V elsewhere"
            )
        return meta


def _split_heads(
    q, k, v, layer, contiguous: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[T, H*D]`` -> ``[T, H, D]`` views of q, k, v.

    ``contiguous``: copy where a view is not contiguous (extend kernels). Decode reads its
    inputs through their strides (only the last dim must be contiguous, which a reshape of
    ``[T, H*D]`` with unit last stride keeps), so it takes the views of SGLang's fused QKV
    output as they are: no copies per layer.
    """
    if layer.qk_head_dim != layer.v_head_dim:
        raise KernelError(f"{BACKEND_NAME}: qk_head_dim != v_head_dim is not supported")
    views = (
        q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim),
        k.reshape(-1, layer.tp_k_head_num, layer.qk_head_dim),
        v.reshape(-1, layer.tp_v_head_num, layer.v_head_dim),
    )
    if contiguous:
        return tuple(t.contiguous() for t in views)
    return views


@register_attention_backend(BACKEND_NAME)
def create_tangram_backend(runner: ModelRunner) -> TangramAttnBackend:
    """SGLang attention-registry factory for ``--attention-backend tangram``."""
    return TangramAttnBackend(runner)


add_attention_backend_choices([BACKEND_NAME])
