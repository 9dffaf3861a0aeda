"""The step's packed, pinned, non-blocking upload on a GPU (run on the device: ``pytest -m gpu``).

Many decode steps of a deferred page table on CUDA, each flushed once with its decode plan
(the backend's path): after every step the device table and lengths equal the host mirror, the
plan equals the host plan, the pinned buffers are reused (its slots in turn, no growth after
the first steps) and the staged copies run on the current stream, in order with the kernels
that read them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tangram_sglang.backend import metadata as md
from tangram_sglang.backend.state import TangramState
from tangram_sglang.bench.synthetic import make_profile
from tangram_sglang.mem.manager import TangramMemory

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEV = torch.device("cuda")
PAGE = 16


def test_steps_flush_once_each_through_reused_pinned_buffers():
    ratio = np.array([[1.0, 0.5, 0.3, 0.1], [0.8, 0.25, 0.6, 0.05]])
    profile = make_profile(ratio, 2, "global", sink_tokens=4, recent_window=16, head_dim=64)
    memory = TangramMemory(profile, PAGE, 4096, 8, 64, kv_pool=None, device=DEV)
    state = TangramState(memory, 1, device=DEV)
    table = memory.table
    table.deferred = True
    rows = np.array([1, 2, 5, 7])
    for row, n in zip(rows.tolist(), (300, 45, 700, 17), strict=True):
        state.allocate_extend([row], [n], [0])
    buffers = md.DecodeGraphBuffers.create(
        8, memory.num_head_groups, 8, 64, torch.bfloat16, DEV, num_layers=2
    )
    side = torch.cuda.Stream()
    # the forward stream of SGLang's overlap scheduler; every upload and every kernel that reads
    # it on this one stream (PackedUpload's contract): a first flush on the default stream
    # would let the loop's fourth upload rewrite that flush's device buffer on `side` while the
    # default stream may still be reading it
    with torch.cuda.stream(side):
        table.flush()
        for step in range(40):
            before = table.uploader.num_uploads
            state.allocate_decode(rows, np.arange(4) + step)
            plan = buffers.fill(rows, 6, table.pages, table.lens, PAGE, table.flush)
            assert table.uploader.num_uploads == before + 1
            page, slot = md.decode_destinations(rows, table.pages, table.lens, PAGE)
            torch.cuda.current_stream().synchronize()
            assert plan.dest_page[:4].cpu().numpy().tolist() == page.tolist()
            assert plan.dest_slot[:4].cpu().numpy().tolist() == slot.tolist()
            assert plan.req_rows.cpu().tolist() == [1, 2, 5, 7, 0, 0]
            assert torch.equal(table.page_table.cpu(), torch.from_numpy(table.pages))
            assert torch.equal(table.group_len.cpu(), torch.from_numpy(table.lens).int())
    sizes = {h.numel() for h in table.uploader._host if h is not None}
    assert len(sizes) <= 2 and all(h.is_pinned() for h in table.uploader._host if h is not None)
