"""Argument checks shared by the kernel launchers and the torch reference.

Kernels trust their launcher (docs/design.md §6): every shape, dtype, device, stride assumption a
kernel makes is checked here, on host-side metadata only (no device sync, so the checks are safe
inside CUDA-graph capture). Failures raise :class:`KernelError` naming the argument and the fix.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NoReturn

import torch

from tangram_sglang.errors import KernelError

KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32,)


def check_tensor(
    name: str,
    tensor: torch.Tensor,
    shape: Sequence[int | None],
    dtypes: Sequence[torch.dtype],
    device: torch.device,
    last_dim_contiguous: bool = True,
) -> None:
    """Check one tensor argument; ``None`` in ``shape`` matches any size.

    Runs once per argument of every kernel launch (about two dozen times per layer of an
    extend batch), so the passing path only compares metadata: the message is built on failure.

    Raises:
        KernelError: not a tensor, wrong rank/size, dtype, device, or a last dim with stride != 1.
    """
    if not isinstance(tensor, torch.Tensor):
        raise KernelError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    got = tensor.shape
    if len(got) != len(shape):
        _raise_shape(name, got, shape)
    for want, have in zip(shape, got, strict=True):
        if want is not None and want != have:
            _raise_shape(name, got, shape)
    if tensor.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise KernelError(f"{name} has dtype {tensor.dtype}, expected one of {names}")
    if tensor.device != device:
        raise KernelError(f"{name} is on {tensor.device} but the kernel runs on {device}")
    if last_dim_contiguous and got and got[-1] > 1 and tensor.stride(-1) != 1:
        raise KernelError(f"{name} needs a contiguous last dim (stride 1); call .contiguous()")


def _raise_shape(name: str, got: torch.Size, shape: Sequence[int | None]) -> NoReturn:
    want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    raise KernelError(f"{name} has shape {list(got)}, expected {want}")


def check_pools(k_pool: torch.Tensor, v_pool: torch.Tensor, device: torch.device) -> None:
    """K/V pools ``[num_pages, H_p, page_size, head_dim]``, same shape, dtype and strides."""
    check_tensor("k_pool", k_pool, (None, None, None, None), KV_DTYPES, device)
    check_tensor("v_pool", v_pool, tuple(k_pool.shape), (k_pool.dtype,), device)
    if k_pool.stride() != v_pool.stride():
        raise KernelError(
            f"k_pool strides {k_pool.stride()} differ from v_pool strides {v_pool.stride()}; "
            "allocate both pools with the same layout"
        )
    page_size, head_dim = k_pool.shape[2], k_pool.shape[3]
    if page_size & (page_size - 1):
        raise KernelError(f"page_size={page_size} (k_pool dim 2) must be a power of two")
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= 256:
        raise KernelError(
            f"head_dim={head_dim} (k_pool dim 3) must be a power of two in [16, 256] "
            "(64 and 128 are tested)"
        )


def check_paging(
    page_table: torch.Tensor,
    group_len: torch.Tensor,
    req_rows: torch.Tensor,
    group_of_head: torch.Tensor,
    column_of_head: torch.Tensor,
    batch_size: int,
    num_kv_heads: int,
    device: torch.device,
) -> None:
    """The ragged page-table arguments of docs/contracts.md (all int32 on ``device``).

    ``page_table [max_rows, num_head_groups, max_pages_per_group]``, ``group_len [max_rows,
    num_head_groups]``, ``req_rows [batch_size]``, ``group_of_head``/``column_of_head
    [num_kv_heads]``.
    """
    check_tensor("page_table", page_table, (None, None, None), INDEX_DTYPES, device)
    rows, groups = page_table.shape[0], page_table.shape[1]
    check_tensor("group_len", group_len, (rows, groups), INDEX_DTYPES, device)
    check_tensor("req_rows", req_rows, (batch_size,), INDEX_DTYPES, device)
    check_tensor("group_of_head", group_of_head, (num_kv_heads,), INDEX_DTYPES, device)
    check_tensor("column_of_head", column_of_head, (num_kv_heads,), INDEX_DTYPES, device)


def check_query(q: torch.Tensor, k_pool: torch.Tensor, name: str = "q") -> tuple[int, int]:
    """A query ``[N, num_qo_heads, head_dim]`` matching the pool; returns (N, num_qo_heads)."""
    if not isinstance(k_pool, torch.Tensor) or k_pool.dim() != 4:
        got = list(k_pool.shape) if isinstance(k_pool, torch.Tensor) else type(k_pool).__name__
        raise KernelError(f"k_pool must be a tensor [num_pages, H_p, page_size, D], got {got}")
    check_tensor(name, q, (None, None, k_pool.shape[3]), (k_pool.dtype,), k_pool.device)
    return q.shape[0], q.shape[1]


def num_kv_heads_of(group_of_head: torch.Tensor, device: torch.device) -> int:
    """H_kv of the layer: the length of ``group_of_head`` (int32 ``[H_kv]`` on ``device``)."""
    check_tensor("group_of_head", group_of_head, (None,), INDEX_DTYPES, device)
    return group_of_head.shape[0]


def check_sm_scale(sm_scale: float) -> None:
    """The softmax scale is a finite real > 0 (a NaN scale would make every output NaN)."""
    ok = isinstance(sm_scale, int | float) and not isinstance(sm_scale, bool)
    if not ok or not math.isfinite(sm_scale) or sm_scale <= 0:
        raise KernelError(
            f"sm_scale={sm_scale!r} must be a finite number > 0 (usually head_dim ** -0.5)"
        )


def gqa_size_of(num_qo_heads: int, num_kv_heads: int) -> int:
    """Query heads per KV head; raises KernelError when they do not divide."""
    if num_kv_heads < 1 or num_qo_heads % num_kv_heads:
        raise KernelError(
            f"num_qo_heads={num_qo_heads} is not a multiple of num_kv_heads={num_kv_heads} "
            "(group_of_head length)"
        )
    return num_qo_heads // num_kv_heads


def check_extend_args(
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
) -> tuple[int, int, int, int]:
    """Checks shared by the extend reference and launcher; returns (N, Hq, H_kv, bs)."""
    num_tokens, num_qo_heads = check_query(q, k_pool)
    check_pools(k_pool, v_pool, q.device)
    num_kv_heads = num_kv_heads_of(group_of_head, q.device)
    gqa_size_of(num_qo_heads, num_kv_heads)
    shape = (num_tokens, num_kv_heads, k_pool.shape[3])
    check_tensor("k_new", k_new, shape, (q.dtype,), q.device)
    check_tensor("v_new", v_new, shape, (q.dtype,), q.device)
    check_tensor("qo_indptr", qo_indptr, (None,), INDEX_DTYPES, q.device)
    bs = qo_indptr.shape[0] - 1
    if bs < 0:
        raise KernelError("qo_indptr must have bs + 1 >= 1 entries")
    check_paging(
        page_table, group_len, req_rows, group_of_head, column_of_head, bs, num_kv_heads, q.device
    )
    return num_tokens, num_qo_heads, num_kv_heads, bs


def check_kv_write_args(
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
) -> int:
    """Checks shared by the kv-write reference and launcher, on host metadata only (no device
    op: the launcher runs once per layer of every extend batch).

    Returns:
        max_k, the width of ``kept_idx``.
    """
    device = k_new.device
    check_pools(k_pool, v_pool, device)
    check_tensor("k_new", k_new, (None, None, k_pool.shape[3]), (k_pool.dtype,), device)
    check_tensor("v_new", v_new, tuple(k_new.shape), (k_pool.dtype,), device)
    num_kv_heads = k_new.shape[1]
    check_tensor("qo_indptr", qo_indptr, (None,), INDEX_DTYPES, device)
    bs = qo_indptr.shape[0] - 1
    check_tensor("kept_idx", kept_idx, (bs, num_kv_heads, None), (torch.int32, torch.int64), device)
    check_paging(
        page_table, group_len, req_rows, group_of_head, column_of_head, bs, num_kv_heads, device
    )
    check_tensor("kept_count", kept_count, (bs, page_table.shape[1]), INDEX_DTYPES, device)
    return kept_idx.shape[2]


def layout_key(args: Sequence[object]) -> tuple:
    """What a launcher's checks read of ``args``: per tensor its shape, dtype, device and
    strides; any other argument itself, with its type (``1`` and ``True`` differ)."""
    key: list = []  # flat: hashing and comparing it is about twice as fast as nested tuples
    for a in args:
        if isinstance(a, torch.Tensor):
            key += (a.shape, a.dtype, a.device, a.stride())
        else:
            key += (type(a), a)
    return tuple(key)


class CheckedLayouts:
    """Argument layouts whose checks already passed, with what the checks returned.

    The checks of this module read metadata only (shapes, dtypes, devices, strides, scalar
    arguments: :func:`layout_key`), so checks that passed for one layout pass for every call
    with the same layout. A launcher given one of these checks each layout once: the first
    layer of an extend batch is checked, the later layers (same shapes, same pools) reuse the
    result, as a FlashInfer plan is checked once and run per layer. A layout is remembered only
    after its checks pass; past ``capacity`` the first remembered is dropped. Hold one per
    launcher: the key does not name the checks. An argument without a key (unhashable, or a
    tensor without strides) is checked on every call.

    Args:
        capacity: layouts kept (an extend batch uses one or a few; batches differ in shape).
    """

    _MISSING = object()

    def __init__(self, capacity: int = 64) -> None:
        if capacity < 1:
            raise ValueError(f"CheckedLayouts: capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._passed: dict[tuple, object] = {}

    def __len__(self) -> int:
        return len(self._passed)

    def lookup(self, key: tuple) -> object:
        """The checks' result for ``key``, or :attr:`_MISSING` when not checked yet."""
        return self._passed.get(key, self._MISSING)

    def remember(self, key: tuple, result: object) -> None:
        """Record that the checks passed for ``key`` and returned ``result``."""
        if key not in self._passed and len(self._passed) >= self.capacity:
            del self._passed[next(iter(self._passed))]
        self._passed[key] = result


def run_once(checked: CheckedLayouts | None, check: Callable, args: tuple) -> object:
    """``check(*args)``, or its remembered result when ``checked`` holds ``args``' layout.

    Args:
        checked: the launcher's checked layouts; None runs ``check`` on every call.
        check: the launcher's checks (metadata only; raises :class:`KernelError`).
        args: the arguments ``check`` takes.

    Raises:
        KernelError: from ``check``, for a layout not checked before (nothing remembered).
    """
    if checked is None:
        return check(*args)
    try:
        key = layout_key(args)
        result = checked.lookup(key)
    except (TypeError, RuntimeError):  # unhashable or strideless (sparse): not remembered
        return check(*args)  # the checks name the argument
    if result is CheckedLayouts._MISSING:
        result = check(*args)
        checked.remember(key, result)
    return result
