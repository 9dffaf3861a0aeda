"""The new tokens' causal attention through FlashInfer's ragged prefill, merged by LSE.

An extend segment's attention has two parts: the request's compressed history (ragged head-group
pages: Tangram's own kernel, ``extend_attention.ragged_extend_attention``) and the segment's own
new tokens, causal. The second part is plain ragged causal attention over contiguous
``[T, H, D]`` tensors, exactly what FlashInfer's ``BatchPrefillWithRaggedKVCacheWrapper`` runs
for stock SGLang's ``flashinfer`` backend (FA2/FA3 kernels, several times the throughput of a
one-query-head-per-program Triton loop on long segments). So:

* :class:`FlashInferNewTokens`: plan once per extend batch (host ``qo_indptr``, no device read),
  run per layer: ``(out, lse)`` of the new tokens over themselves, causal;
* :func:`causal_new_token_reference`: the same in torch (CPU, the tests' oracle);
* :func:`merge_states`: two partial attentions over disjoint key sets into one (the LSE merge of
  split-KV attention);
* :func:`split_extend`: the new tokens' part, plus, only when some request has history, the
  history part (Tangram's kernel with ``new_tokens=False``) merged in.

LSE convention: natural log of ``sum_j exp(sm_scale * q . k_j)``, as Tangram's kernels write it
and the scorers read it. FlashInfer's prefill wrappers return base-2 LSE (``log2 sum 2^(...)``);
:class:`FlashInferNewTokens` converts (``* ln 2``).

Source: FlashAttention-2 (Dao 2023) split-KV merge; SGLang 0.5.17
``layers/attention/flashinfer_backend.py`` (ragged new tokens + paged prefix, merged by
``merge_state``); FlashInfer 0.6 ``prefill.BatchPrefillWithRaggedKVCacheWrapper``
(``begin_forward`` / ``forward_return_lse``, the calls SGLang's backend makes).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from tangram_sglang.errors import ConfigError, KernelError

logger = logging.getLogger(__name__)

# FlashInfer's workspace (bytes): SGLang 0.5.17's default for its flashinfer backend
# (SGLANG_FLASHINFER_WORKSPACE_SIZE, 384 MiB; it raises it to 512 MiB for Qwen2/Qwen3 models,
# for the split-KV scratch of decode, which this path does not run).
WORKSPACE_BYTES = 384 * 1024 * 1024
# the dtypes FlashInfer's prefill kernels take
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)


def check_flashinfer(dtype: torch.dtype, switch: str) -> None:
    """FlashInfer's prefill can run a model of ``dtype`` here (``switch``: the environment
    variable that asked for it, named in the errors).

    Raises:
        ConfigError: a dtype FlashInfer's prefill does not take (float32).
        KernelError: the flashinfer package cannot be imported.
    """
    if dtype not in FLASHINFER_DTYPES:
        raise ConfigError(
            f"{switch}=flashinfer runs FlashInfer's prefill, which takes float16 or bfloat16, "
            f"not the model's {dtype}; pass --dtype bfloat16 or unset {switch}"
        )
    try:
        import flashinfer.prefill  # noqa: F401
    except ImportError as exc:  # pragma: no cover - sglang depends on flashinfer-python
        raise KernelError(
            f"{switch}=flashinfer needs the flashinfer-python package ({exc}); install it or "
            f"unset {switch}"
        ) from exc


def flashinfer_fallback(what: str, exc: Exception, instead: str) -> None:
    """Log, as a warning, that FlashInfer ``what`` (e.g. ``"prefill failed its start-up run"``)
    with the exception ``exc``, and what runs ``instead``. OOM is never passed here: a full
    device is re-raised by the callers, not hidden behind a fallback."""
    logger.warning("Tangram: FlashInfer's %s (%s: %s); %s", what, type(exc).__name__, exc, instead)


def check_finite(out: torch.Tensor) -> None:
    """Raise unless every value of a start-up run's output is finite (one device sync: for
    start-up checks only, never on the step path).

    Raises:
        FloatingPointError: "non-finite start-up output".
    """
    if not bool(torch.isfinite(out.float()).all()):
        raise FloatingPointError("non-finite start-up output")


class NewTokenAttention(Protocol):
    """The new tokens' causal attention of an extend batch (plan per batch, run per layer)."""

    def plan(
        self, bounds: Sequence[int], num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype
    ) -> None:
        """Prepare for a batch whose request i owns tokens ``bounds[i]:bounds[i + 1]``."""

    def run(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [T, H_q, D] q's dtype, lse float32 [T, H_q] natural log)`` of one layer."""


def causal_new_token_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: Sequence[int], sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged causal attention of each request's new tokens over themselves (torch, float32).

    Args:
        q: ``[T, H_q, D]``; k, v: ``[T, H_kv, D]`` (post-RoPE; GQA: query head h reads KV head
            ``h // (H_q // H_kv)``).
        bounds: ``bs + 1`` host ints: request i owns tokens ``bounds[i]:bounds[i + 1]``.
        sm_scale: softmax scale.

    Returns:
        ``(out, lse)``: out ``[T, H_q, D]`` in q's dtype; lse float32 ``[T, H_q]``, natural log.
    """
    num_qo_heads, num_kv_heads = q.shape[1], k.shape[1]
    gqa = num_qo_heads // num_kv_heads
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], num_qo_heads, dtype=torch.float32, device=q.device)
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        n = end - start
        if n == 0:
            continue
        qs = q[start:end].float().transpose(0, 1)  # [H_q, n, D]
        ks = k[start:end].float().transpose(0, 1).repeat_interleave(gqa, 0)  # [H_q, n, D]
        vs = v[start:end].float().transpose(0, 1).repeat_interleave(gqa, 0)
        logits = torch.matmul(qs, ks.transpose(1, 2)) * sm_scale  # [H_q, n, n]
        future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        logits.masked_fill_(future, float("-inf"))
        norm = torch.logsumexp(logits, dim=-1)  # [H_q, n]
        out[start:end] = torch.matmul(torch.exp(logits - norm.unsqueeze(-1)), vs).transpose(0, 1)
        lse[start:end] = norm.transpose(0, 1)
    return out, lse


class TorchNewTokens:
    """:class:`NewTokenAttention` by :func:`causal_new_token_reference` (CPU and tests)."""

    def __init__(self) -> None:
        self.bounds: list[int] = []

    def plan(self, bounds, num_qo_heads, num_kv_heads, head_dim, dtype) -> None:
        """Keep the batch's bounds (host ints)."""
        self.bounds = list(bounds)

    def run(self, q, k, v, sm_scale):
        """``(out, lse)`` of the planned batch (:func:`causal_new_token_reference`)."""
        return causal_new_token_reference(q, k, v, self.bounds, sm_scale)


class FlashInferNewTokens:
    """:class:`NewTokenAttention` by FlashInfer's ragged prefill wrapper (CUDA).

    Args:
        device: a CUDA device.
        dtype: the model's (and KV pool's) dtype.

    Raises:
        ConfigError: a dtype FlashInfer's prefill does not take (float32): the message names
            ``TANGRAM_PREFILL_ATTENTION`` and the fix.
        KernelError: flashinfer cannot be imported (the message names the fix).
    """

    def __init__(self, device, dtype: torch.dtype) -> None:
        check_flashinfer(dtype, "TANGRAM_PREFILL_ATTENTION")
        from flashinfer.prefill import BatchPrefillWithRaggedKVCacheWrapper

        # FlashInfer's float workspace; the paged-history wrapper shares it (one stream)
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.wrapper = BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD")
        self.planned_at: torch.cuda.Event | None = None  # after the last plan's queued copy

    def plan(self, bounds, num_qo_heads, num_kv_heads, head_dim, dtype) -> None:
        """FlashInfer's plan for the batch, from a pinned host ``qo_indptr`` (no device read, no
        copy that waits for the GPU).

        FlashInfer stages the plan in the wrapper's pinned buffer and queues its copy without
        waiting; this plan first waits for an event recorded after the previous plan's copy,
        so it cannot overwrite the buffer before that copy has run (normally long done).
        """
        if self.planned_at is not None:
            self.planned_at.synchronize()
        # pinned: plan() copies the indptrs to the device; from pageable memory each such copy
        # would wait for the stream's queued work (the previous batch) before it starts
        indptr = torch.tensor(list(bounds), dtype=torch.int32).pin_memory()
        self.wrapper.begin_forward(
            indptr, indptr, num_qo_heads, num_kv_heads, head_dim, causal=True, q_data_type=dtype
        )
        self.planned_at = torch.cuda.Event()
        self.planned_at.record()

    def run(self, q, k, v, sm_scale):
        """``(out, lse)`` of one layer; FlashInfer's base-2 LSE turned into natural log."""
        out, lse2 = self.wrapper.forward_return_lse(q, k, v, causal=True, sm_scale=sm_scale)
        return out, lse2.mul_(math.log(2.0))


def merge_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over keys ``A + B`` from the attentions over ``A`` and over ``B``.

    ``lse = log(e^lse_a + e^lse_b)``, ``out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b``
    (FlashAttention-2's split-KV merge). A side with no key (``lse = -inf``, output 0) drops
    out; both sides empty is not allowed (a new token always sees itself).

    Args:
        out_a, out_b: ``[T, H, D]`` same dtype; lse_a, lse_b: float32 ``[T, H]``, natural log.

    Returns:
        ``(out [T, H, D] in out_a's dtype, lse float32 [T, H])``.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse).unsqueeze(-1)
    w_b = torch.exp(lse_b - lse).unsqueeze(-1)
    out = torch.addcmul(out_b.float() * w_b, out_a.float(), w_a)
    return out.to(out_a.dtype), lse


def split_extend(
    new_tokens: NewTokenAttention,
    history: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Extend attention as the new tokens' part (planned) plus, if given, the history's part.

    Args:
        new_tokens: a planned :class:`NewTokenAttention` for this batch.
        history: ``None`` when no request of the batch has history, else a callable returning
            the history part ``(out, lse)`` (``ragged_extend_attention(..., new_tokens=False)``).
        q: ``[T, H_q, D]``; k, v: ``[T, H_kv, D]`` (post-RoPE, the pool's dtype).
        sm_scale: softmax scale.

    Returns:
        ``(out, lse)`` as ``ragged_extend_attention`` (natural-log LSE over history + new).
    """
    out, lse = new_tokens.run(q, k, v, sm_scale)
    if history is None:
        return out, lse
    out_h, lse_h = history()
    return merge_states(out_h, lse_h, out, lse)
