"""Host cost per request of a round of later chat turns on the real scheduler-side path (CPU).

    python -m tangram_sglang.bench.turn_host --conversations 64 --rounds 3
    python -m tangram_sglang.bench.turn_host --batch-size 2   # turns admitted two at a time

What the scheduler's host does for each turn of ``--conversations`` chats that arrive together
(as every chat of a benchmark round does), on the real :class:`TangramRadixCache` over
:class:`TangramState` and SGLang's own ``ReqToTokenPool`` / ``TokenToKVPoolAllocator`` (no
server, no model, nothing mocked):

  match      SGLang's ``match_prefix`` on the tree and ``inc_lock_ref`` (SGLang's own work)
  allocate   ``TangramState.allocate_extend`` for the whole batch (admission, prefix, pages)
  plan       the batch plan's host side: copy-on-write copies and the page-table upload
  decode     ``allocate_decode`` + plan of one decode step of the batch (per step)
  finish     ``cache_finished_req`` of each request (segments into the tree, row freed), all
             in one result step (``deferred_finishes``, as the server's hook runs them)

and reports the best-of-``--rounds`` time per request (per step for ``decode``) in
milliseconds. The turns after the first reuse the cached history (a partial last page per head
group is copied on write), which is the path a later turn takes in a server. The GPU waits for
this work whenever no batch is queued, e.g. between the rounds of a benchmark: ``allocate`` +
``plan`` + ``finish`` times the batch size is host time on the critical path of every round.

Default shape: Llama-3.1-8B KV geometry (32 layers x 8 KV heads), the skewed synthetic 0.25
profile, H_p = 4 global grouping (64 head groups), page 16, segments under 256 tokens kept
whole, a 1,024-token first turn, then +128 tokens and 32 output tokens per turn. The K/V
storage lives on PyTorch's meta device (head_dim 1): its copies cost their launch, not their
bytes, as on a GPU where they are queued; the host work does not depend on head_dim.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from array import array
from types import SimpleNamespace

import numpy as np

STAGES = ("match", "allocate", "plan", "decode", "finish")
MAX_POOL_PAGES = 4_000_000  # the run then holds about 1 GB


@dataclasses.dataclass
class TurnWorld:
    """The real tree, state and SGLang pools of one CPU run (built by :func:`build_world`)."""

    tree: object  # TangramRadixCache
    state: object  # TangramState
    req_pool: object  # sglang ReqToTokenPool
    slots: object  # sglang TokenToKVPoolAllocator


def build_world(
    num_rows: int, context_tokens: int, num_pages: int, min_compress_tokens: int = 256
) -> TurnWorld:
    """A fresh world as a ``--tangram`` server builds it (deferred page-table uploads and
    copy-on-write copies, as the attention backend sets them), on the CPU.

    Args:
        num_rows: request rows (at least the conversations of a round).
        context_tokens: the longest conversation (tokens); sizes rows and token slots.
        num_pages: pool pages (padding page 0 included).
        min_compress_tokens: segments shorter than this are kept whole (the server's default).
    """
    import torch
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from tangram_sglang.backend.state import TangramState
    from tangram_sglang.bench.synthetic import skewed_profile
    from tangram_sglang.mem.kv_pool import KVPool
    from tangram_sglang.mem.manager import TangramMemory
    from tangram_sglang.radix.cache import TangramRadixCache

    prof = skewed_profile("llama3-8b", 0.25, 4, "global").with_min_compress_tokens(
        min_compress_tokens
    )
    prof = dataclasses.replace(prof, model=dataclasses.replace(prof.model, head_dim=1))
    page = 16
    # K/V on the meta device: the copies are queued shapes, as kernels on a GPU are queued
    pool = KVPool.create(num_pages, prof.grouping.heads_per_group, page, 1, torch.bfloat16, "meta")
    memory = TangramMemory(prof, page, num_pages, num_rows + 1, -(-context_tokens // page), pool)
    memory.table.deferred = True  # as TangramAttnBackend: one upload per batch plan
    memory.defer_copies = True
    state = TangramState(memory, full_kv_bytes_per_token=131072, device="cpu", chunk_tokens=8192)
    req_pool = ReqToTokenPool(num_rows, context_tokens, "cpu", False)
    req_pool.tangram_state = state
    slots = TokenToKVPoolAllocator(num_rows * context_tokens, torch.float32, "cpu", None, False)
    params = CacheInitParams(
        disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=slots, page_size=1
    )
    return TurnWorld(TangramRadixCache(params), state, req_pool, slots)


def play_round(
    world: TurnWorld,
    prompts: list[list[int]],
    output_tokens: int,
    rng: np.random.Generator,
    batch_size: int | None = None,
) -> tuple[dict[str, float], list[list[int]]]:
    """One round: every prompt is matched, prefilled, decoded as one batch, finished.

    Args:
        batch_size: requests per prefill batch (allocated and planned batch after batch, as a
            server admits turns that arrive a few at a time); None: all in one batch.

    Returns:
        ``({stage: seconds}, conversations)``: each stage's host time for the whole batch, and
        each conversation after the round (prompt + its outputs).
    """
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    tree, state, req_pool, slots = world.tree, world.state, world.req_pool, world.slots
    memory, times, reqs = state.memory, dict.fromkeys(STAGES, 0.0), []
    for prompt in prompts:
        t0 = time.perf_counter()
        key = RadixKey(array("q", prompt), None, limit=len(prompt) - 1)  # as SGLang's key
        match = tree.match_prefix(MatchPrefixParams(key=key))
        node, done = match.last_device_node, len(match.device_indices)
        tree.inc_lock_ref(node)
        times["match"] += time.perf_counter() - t0
        row = req_pool.free_slots.pop(0)
        req_pool.req_to_token[row, :done] = match.device_indices.to(torch.int32)
        fresh = slots.alloc(len(prompt) - done).to(torch.int32)
        req_pool.req_to_token[row, done : len(prompt)] = fresh
        reqs.append(
            SimpleNamespace(
                req_pool_idx=row,
                last_node=node,
                cache_protected_len=done,
                origin_input_ids=array("q", prompt),
                output_ids=array("q"),
                extra_key=None,
                priority=0,
            )
        )
    rows = [r.req_pool_idx for r in reqs]
    prefix = [r.cache_protected_len for r in reqs]
    extend_lens = [len(r.origin_input_ids) - p for r, p in zip(reqs, prefix, strict=True)]
    step = len(reqs) if batch_size is None else int(batch_size)
    for lo in range(0, len(reqs), step):
        batch = slice(lo, lo + step)
        t0 = time.perf_counter()
        state.host_prefix_nodes = {r.req_pool_idx: r.last_node for r in reqs[batch]}
        state.allocate_extend(rows[batch], extend_lens[batch], prefix[batch])
        times["allocate"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        memory.run_copies()
        memory.table.flush()
        times["plan"] += time.perf_counter() - t0
    for _ in range(output_tokens):
        for r in reqs:
            seq = len(r.origin_input_ids) + len(r.output_ids)
            req_pool.req_to_token[r.req_pool_idx, seq] = int(slots.alloc(1)[0])
            r.output_ids.append(int(rng.integers(100, 30000)))
        seq_lens = [len(r.origin_input_ids) + len(r.output_ids) for r in reqs]
        t0 = time.perf_counter()
        state.allocate_decode(rows, seq_lens)
        memory.run_copies()
        memory.table.flush()
        times["decode"] += time.perf_counter() - t0
    conversations = []
    t0 = time.perf_counter()
    with tree.deferred_finishes():  # one result step, as the server's hook runs it
        for r in reqs:
            r.output_ids.append(9)  # the last sampled token (no KV)
            kv_len = len(r.origin_input_ids) + output_tokens
            tree.cache_finished_req(r, True, kv_len_to_handle=kv_len)
            state.release(r.req_pool_idx)  # SGLang's ReqToTokenPool.free hook
            req_pool.free_slots.append(r.req_pool_idx)
    times["finish"] += time.perf_counter() - t0
    for r in reqs:
        conversations.append([*r.origin_input_ids, *r.output_ids[:-1]])
    return times, conversations


def turn_host_cost(
    conversations: int = 64,
    first_turn_tokens: int = 1024,
    next_turn_tokens: int = 128,
    output_tokens: int = 32,
    rounds: int = 3,
    seed: int = 0,
    batch_size: int | None = None,
) -> dict[str, float]:
    """Best per-request host time (ms) of each stage over ``rounds`` later-turn rounds.

    Round 0 (the first turns) warms the tree and is not reported; each later round appends
    ``next_turn_tokens`` new tokens to every conversation. ``batch_size``: requests per
    prefill batch of the later rounds (:func:`play_round`; None: all at once).

    Returns:
        ``{stage: ms}`` for :data:`STAGES` (``decode`` per step of the batch, the others per
        request), plus ``"per_turn"``: allocate + plan + finish per request (ms).

    Raises:
        ValueError: a count below 1, or a pool over ``MAX_POOL_PAGES`` pages.
    """
    counts = (conversations, first_turn_tokens, next_turn_tokens, output_tokens, rounds)
    if min(counts) < 1 or (batch_size is not None and batch_size < 1):
        raise ValueError("turn_host_cost: every count must be >= 1")
    rng = np.random.default_rng(seed)
    context = first_turn_tokens + (rounds + 1) * (next_turn_tokens + output_tokens) + 16
    pages_per_conv = 64 * (-(-context // 16) + 2)  # every group whole, plus copies
    if conversations * pages_per_conv > MAX_POOL_PAGES:
        raise ValueError(
            f"turn_host_cost: {conversations} conversations of up to {context} tokens need "
            f"{conversations * pages_per_conv:,} pages, over {MAX_POOL_PAGES:,}; use fewer "
            "conversations, rounds or tokens"
        )
    world = build_world(conversations + 1, context, conversations * pages_per_conv + 1)
    convs = [rng.integers(100, 30000, first_turn_tokens).tolist() for _ in range(conversations)]
    _, convs = play_round(world, convs, output_tokens, rng)
    best = dict.fromkeys(STAGES, float("inf"))
    for _ in range(rounds):
        convs = [c + rng.integers(100, 30000, next_turn_tokens).tolist() for c in convs]
        times, convs = play_round(world, convs, output_tokens, rng, batch_size)
        for stage, seconds in times.items():
            per = output_tokens if stage == "decode" else conversations
            best[stage] = min(best[stage], seconds / per * 1e3)
    out = {stage: round(ms, 4) for stage, ms in best.items()}
    out["per_turn"] = round(best["allocate"] + best["plan"] + best["finish"], 4)
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI: print the per-request host cost of each stage (a table, or JSON with ``--json``)."""
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--conversations", type=int, default=64, help="chats per round (a batch)")
    ap.add_argument("--first-turn-tokens", type=int, default=1024, help="round 0 prompt")
    ap.add_argument("--next-turn-tokens", type=int, default=128, help="new tokens per turn")
    ap.add_argument("--output-tokens", type=int, default=32, help="decode steps per turn")
    ap.add_argument("--rounds", type=int, default=3, help="later-turn rounds timed")
    ap.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="requests per prefill batch of the later turns (a server admits turns that "
        "arrive a few at a time in batches of a few); default: all conversations at once",
    )
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args(argv)
    for flag in ("conversations", "first_turn_tokens", "next_turn_tokens", "output_tokens"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 1")
    for flag in ("rounds", "batch_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            ap.error(f"--{flag.replace('_', '-')} {value}: must be >= 1")
    try:
        out = turn_host_cost(
            args.conversations,
            args.first_turn_tokens,
            args.next_turn_tokens,
            args.output_tokens,
            args.rounds,
            batch_size=args.batch_size,
        )
    except ValueError as exc:
        ap.error(str(exc))
    if args.json:
        json.dump(out, sys.stdout, indent=1)
        print()
        return 0
    for stage, ms in out.items():
        unit = "ms per decode step" if stage == "decode" else "ms per request"
        print(f"{stage:<10}{ms:>10.3f}  {unit}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
