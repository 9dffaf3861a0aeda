"""Tables built by TangramMemory read correctly through the kernels' torch reference.

Two layers x 2 KV heads, H_p = 2 in global scope (groups span layers), page_size 4. Request A
prefills and decodes, finishes into a "node"; request B reuses A's chain as its prefix (COW of
the shared tail pages), extends and decodes. Every kept K/V row is written at the (page, column,
slot) the page table gives; the reference decode over B's row must equal dense attention over
the tokens each head should hold.
"""

import numpy as np
import torch
from factories import make_profile

from tangram_sglang.kernels.reference import decode_reference
from tangram_sglang.mem.kv_pool import KVPool
from tangram_sglang.mem.manager import PrefixMatch, TangramMemory

D, PAGE = 16, 4


class Writer:
    """Writes random K/V for appended tokens and remembers each head's dense sequence."""

    def __init__(self, mem: TangramMemory, gen: torch.Generator):
        self.mem, self.gen = mem, gen
        self.grouping = mem.profile.grouping
        self.seqs: dict[int, dict[tuple[int, int], list[torch.Tensor]]] = {}

    def append(self, row: int, group: int, positions: range) -> None:
        for layer, head in self.grouping.members(group):
            col = int(self.grouping.column_of[layer, head])
            for t in positions:
                kv = torch.randn(2, D, generator=self.gen, dtype=torch.float32)
                page = int(self.mem.table.pages[row, group, t // PAGE])
                ids = (torch.tensor([page]), torch.tensor([col]), torch.tensor([t % PAGE]))
                self.mem.kv_pool.write(*ids, kv[:1], kv[1:])
                seq = self.seqs.setdefault(row, {}).setdefault((layer, head), [])
                assert len(seq) == t
                seq.append(kv)


def test_reference_decode_reads_what_the_manager_laid_out():
    prof = make_profile([[1.0, 0.3], [0.6, 0.2]], heads_per_group=2, scope="global", head_dim=D)
    pool = KVPool.create(32, 2, PAGE, D, torch.float32)
    mem = TangramMemory(prof, PAGE, 32, 2, 16, pool, debug=True)
    w = Writer(mem, torch.Generator().manual_seed(0))
    groups = range(mem.num_head_groups)

    def extend(row, n):
        plan = mem.alloc_extend(row, n)
        for g in groups:
            w.append(
                row, g, range(int(plan.start_len[g]), int(plan.start_len[g] + plan.kept_len[g]))
            )
        mem.commit_extend(row)

    def decode(row):
        mem.alloc_decode([row])
        for g in groups:
            n = int(mem.table.lens[row, g])
            w.append(row, g, range(n - 1, n))

    assert mem.admit(0, "a", 9, 3) is not None
    extend(0, 9)
    decode(0)
    decode(0)
    table = [mem.group_pages(0, g) for g in groups]
    lens = mem.table.lens[0].copy()
    node_seqs = w.seqs.pop(0)
    mem.finish(0)

    prefix = PrefixMatch(table, lens)
    assert mem.admit(1, "b", 5, 2, prefix) is not None
    w.seqs[1] = {k: list(v) for k, v in node_seqs.items()}
    extend(1, 5)
    decode(1)
    assert mem.ledger.by_row[1].used_pages == mem.ledger.by_row[1].reserved_pages

    q = torch.randn(1, 2, D, generator=w.gen, dtype=torch.float32)
    for layer in range(2):
        got = decode_reference(
            q,
            pool.k_pool,
            pool.v_pool,
            mem.table.page_table,
            mem.table.group_len,
            torch.tensor([1], dtype=torch.int32),
            torch.from_numpy(prof.grouping.cluster_of[layer]).int(),
            torch.from_numpy(prof.grouping.column_of[layer]).int(),
            D**-0.5,
        )
        for head in range(2):
            kv = torch.stack(w.seqs[1][(layer, head)])  # [tokens, 2, D]
            probs = torch.softmax(kv[:, 0] @ q[0, head] * D**-0.5, dim=0)
            torch.testing.assert_close(got[0, head], probs @ kv[:, 1])
    assert np.array_equal(
        mem.table.group_len[1].numpy(),
        [len(w.seqs[1][m[0]]) for m in map(prof.grouping.members, groups)],
    )
