"""CPU-development stand-in for ``sgl_kernel`` (SGLang 0.5.17's compiled kernel package).

FOR CPU DEVELOPMENT AND CI ONLY. The PyPI ``sglang-kernel`` wheel is CUDA-only and fails to import
without a GPU driver, yet SGLang 0.5.17 imports a few ``*_cpu`` ops at module level when
``SGLANG_USE_CPU_ENGINE=1``. This package shadows the real one when its parent folder comes first
on ``PYTHONPATH`` (``tangram_sglang.serving`` does that for ``--device cpu`` only).

* The two ops the CPU path can reach are implemented in pure torch / ctypes.
* The speculative-decoding ops raise ``NotImplementedError`` naming the op.
* Any other name raises ``AttributeError`` (so ``from sgl_kernel import X`` is an ImportError).
* No ``torch.ops.sgl_kernel.*`` op is registered, so SGLang's ``cpu_has_amx_support()`` is False and
  every layer takes its pure-torch ``forward_native`` path.
* Importing it on a machine with a CUDA GPU raises ``ImportError``: the real package must be used.

The op list comes from an AST walk over sglang 0.5.17 (module-level ``from sgl_kernel import``
under ``_is_cpu``/``is_cpu()``); ``tests/unit/test_cpu_standin.py`` re-checks it on the installed
sglang.
"""

from __future__ import annotations

import ctypes
import os

import torch

if torch.cuda.is_available():
    raise ImportError(
        "tangram_sglang's CPU stand-in for sgl_kernel was imported on a machine with a CUDA GPU; "
        "remove tangram_sglang/cpu_standin from PYTHONPATH so the real sgl_kernel is used"
    )

__version__ = "0.4.5+cpu-standin"
_LOG = os.environ.get("SGL_KERNEL_STANDIN_LOG")
_logged: set[str] = set()


def _note(op: str) -> None:
    """Append ``pid op`` to $SGL_KERNEL_STANDIN_LOG the first time this process calls ``op``."""
    if _LOG and op not in _logged:
        _logged.add(op)
        with open(_LOG, "a") as f:
            f.write(f"{os.getpid()} {op}\n")


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new cache slots into its ``req_to_token`` row.

    For request i: ``req_to_token[req_pool_indices[i], start[i]:end[i]] = out_cache_loc[o:o+n]``
    with ``n = end[i] - start[i]`` and ``o`` the sum of the previous requests' ``n`` (the same
    as SGLang's Triton ``assign_req_to_token_pool``).

    Args:
        req_pool_indices: int ``[bs]`` request rows.
        req_to_token: int32 ``[num_rows, pool_len]``, written in place.
        start_offset, end_offset: int ``[bs]`` token offsets in the row.
        out_cache_loc: int ``[sum(end - start)]`` slot ids.
        pool_len: row length of ``req_to_token`` (unused; kept for the signature).
    """
    _note("assign_req_to_token_pool_cpu")
    offset = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """Copy rows ``src_loc`` to rows ``tgt_loc`` in every KV buffer (``buf[tgt] = buf[src]``).

    Args:
        data_ptrs: int64 ``[num_buffers]`` raw base addresses of the KV buffers.
        strides: int64 ``[num_buffers]`` row sizes in bytes.
        tgt_loc, src_loc: int ``[n]`` row indices. All source rows are read before any write.
    """
    _note("copy_all_layer_kv_cache_cpu")
    tgt, src = tgt_loc.tolist(), src_loc.tolist()
    for base, row_bytes in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        rows = [ctypes.string_at(base + s * row_bytes, row_bytes) for s in src]
        for t, data in zip(tgt, rows, strict=True):
            ctypes.memmove(base + t * row_bytes, data, row_bytes)


def _speculative_only(name: str):
    def stub(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not implemented by tangram_sglang's CPU stand-in: it is only "
            "used by speculative decoding, which the CPU development path does not support"
        )

    stub.__name__ = stub.__qualname__ = name
    stub.__doc__ = "Not implemented on CPU (speculative decoding only): raises NotImplementedError."
    return stub


_SPECULATIVE_OPS = (
    "assign_extend_cache_locs_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
)
globals().update({name: _speculative_only(name) for name in _SPECULATIVE_OPS})

IMPLEMENTED_OPS = ("assign_req_to_token_pool_cpu", "copy_all_layer_kv_cache_cpu")
ALL_OPS = IMPLEMENTED_OPS + _SPECULATIVE_OPS


def __getattr__(name: str):
    raise AttributeError(
        f"sgl_kernel.{name} is not provided by tangram_sglang's CPU stand-in (CPU development "
        f"only; it provides {', '.join(ALL_OPS)})"
    )
