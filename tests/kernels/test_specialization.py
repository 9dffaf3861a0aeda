"""Tangram's Triton kernels build once per server, not once per batch shape.

Triton compiles a kernel again for every new combination of its integer arguments' "== 1" and
"divisible by 16" properties (and its pointers' 16-byte alignment) unless the argument is marked
``do_not_specialize``. A per-batch count (segment length, window width, page-id entries, the
stride of a ``[bs, H, max_k]`` index) would then compile inside the forward of the first batch
that meets a new combination: a stall of a Triton build in a serving step. The rule checked
here: every integer argument of a launched kernel that is neither a stride nor a pointer is
marked; so are the strides that follow a batch's shape.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

import tangram_sglang.kernels as kernels_pkg

# strides that follow the batch's shape (everything else a kernel takes a stride of is laid out
# by the model or the pool, fixed per server)
BATCH_STRIDES = {"_kv_write_kernel": {"stride_ki_b", "stride_ki_h"}}
# pointers that serving passes as slices at a batch-dependent offset (their 16-byte alignment
# changes from batch to batch), marked do_not_specialize_on_alignment
BATCH_POINTERS = {
    "_page_ids_kernel": {"group_offset_ptr", "column_ptr"},
    "_replay_max_kernel": {"lse_ptr"},
}
# float arguments (never specialised by Triton)
FLOATS = {"sm_scale", "sm_scale_log2"}


def _launched_kernels() -> list[tuple[str, JITFunction]]:
    """Every ``@triton.jit`` function of ``tangram_sglang.kernels`` that its module launches
    (``name[grid](...)``), as ``(module.name, function)``; under ``TRITON_INTERPRET=1`` rebuilt
    as the ``JITFunction`` a GPU server would compile, with the decorator's marks."""
    found = []
    for info in pkgutil.iter_modules(kernels_pkg.__path__):
        module = importlib.import_module(f"{kernels_pkg.__name__}.{info.name}")
        source = inspect.getsource(module)
        for name, value in vars(module).items():
            if isinstance(value, InterpretedFunction):  # TRITON_INTERPRET=1 (CPU)
                marks = ("do_not_specialize", "do_not_specialize_on_alignment")
                value = JITFunction(value.fn, **{k: value.kwargs[k] for k in marks})
            if isinstance(value, JITFunction) and re.search(rf"\b{name}\[", source):
                found.append((f"{info.name}.{name}", value))
    return found


def test_the_scan_finds_every_serving_kernel_and_the_tables_name_real_parameters():
    found = dict(_launched_kernels())
    assert set(found) == {
        "decode_attention._decode_stage1",
        "decode_attention._decode_stage2",
        "decode_kv_write._decode_kv_write_kernel",
        "extend_attention._extend_kernel",
        "history_page_ids._page_ids_kernel",
        "kv_write._kv_write_kernel",
        "replay_scores._replay_max_kernel",
        "window_scores._query_max_kernel",
        "window_scores._window_scores_kernel",
    }
    by_kernel = {name.split(".")[1]: kernel for name, kernel in found.items()}
    for table in (BATCH_STRIDES, BATCH_POINTERS):
        for kernel_name, params in table.items():
            assert params <= {p.name for p in by_kernel[kernel_name].params}, kernel_name


@pytest.mark.parametrize("name,kernel", _launched_kernels(), ids=lambda x: str(x))
def test_per_batch_integers_are_not_specialized(name, kernel):
    unmarked, unaligned = [], []
    kernel_name = name.split(".")[1]
    batch_strides = BATCH_STRIDES.get(kernel_name, set())
    batch_pointers = BATCH_POINTERS.get(kernel_name, set())
    for param in kernel.params:
        if param.name in batch_pointers and not param.do_not_specialize_on_alignment:
            unaligned.append(param.name)
        if param.is_constexpr or param.name.endswith("_ptr") or param.name in FLOATS:
            continue
        if param.name.startswith("stride_") and param.name not in batch_strides:
            continue
        if not param.do_not_specialize:
            unmarked.append(param.name)
    assert not unmarked, (
        f"{name}: {unmarked} would compile the kernel again for new batch shapes; add them to "
        "@triton.jit(do_not_specialize=[...]) (or, for a stride fixed per server, name it stride_*)"
    )
    assert not unaligned, (
        f"{name}: {unaligned} are slices at batch-dependent offsets; add them to "
        "@triton.jit(do_not_specialize_on_alignment=[...])"
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton's compile cache needs CUDA")
def test_new_entry_counts_reuse_the_page_id_kernel():
    """Entry counts of each divisibility class and two layers' head-map rows (8-byte apart) run
    on one compiled page-id kernel."""
    from tangram_sglang.kernels.history_attention import PagedHistoryIds
    from tangram_sglang.kernels.history_page_ids import _page_ids_kernel, write_layer_page_ids

    device = torch.device("cuda")
    _page_ids_kernel.device_caches.clear()  # other tests may have built it with another BLOCK
    maps = torch.zeros(2, 1, dtype=torch.int64, device=device)
    for nnz in (1, 16, 17, 48, 1000):
        ids = PagedHistoryIds(
            table=torch.arange(4, dtype=torch.int32, device=device),
            head=torch.zeros(nnz, dtype=torch.int64, device=device),
            base=torch.arange(nnz, dtype=torch.int64, device=device) % 4,
            group_offset=maps,
            column_of=maps,
            heads_per_group=1,
        )
        for layer in (0, 1):
            out = write_layer_page_ids(
                ids, layer, torch.empty(nnz, dtype=torch.int32, device=device)
            )
            assert out.tolist() == (torch.arange(nnz) % 4).tolist()
    kernel_cache = _page_ids_kernel.device_caches[torch.cuda.current_device()][0]
    assert len(kernel_cache) == 1
