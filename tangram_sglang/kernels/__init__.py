"""Attention kernels over ragged per-head-group page tables (no sglang imports).

Modules (import them directly; this package imports nothing, so the CPU path can use the torch
reference without importing Triton):

* ``split_table``: the ahead-of-time split-KV table (start-up, CPU numpy).
* ``reference``: pure-torch decode / extend / kept-KV write: the CPU serving path and the oracle.
* ``decode_attention``: Triton split-KV decode, :func:`ragged_decode_attention`.
* ``extend_attention``: Triton extend over compressed history + causal new tokens,
  :func:`ragged_extend_attention`.
* ``kv_write``: Triton gather of the kept tokens into reserved pages, :func:`write_kept_kv`.

Layouts and calling conventions: docs/contracts.md. Kernels take plain tensors, never pool
objects; launchers check shapes/dtypes/strides and raise ``KernelError``.
"""
