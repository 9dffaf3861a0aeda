"""KVzip-lite, the query-agnostic scorer: its rule against a brute-force loop, the serving path
(``backend.compress``) against its per-request oracle, and NVIDIA kvpress 0.5.5's ``KVzipPress``
as the oracle on the real SmolLM2 model:

* fed the queries and keys of KVzip's reconstruction pass, the scorer reproduces kvpress's KVzip
  scores (max over the reconstruction queries and the GQA group), layer by layer;
* fed the context prefill's own queries (what the server has), its kept set agrees with KVzip's
  more than SnapKV's window scores do.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tangram_sglang.backend.compress import batch_kept_indices, reference_kept_indices
from tangram_sglang.errors import ConfigError
from tangram_sglang.scoring import KVzipLiteScorer, get_scorer, select_kept
from tangram_sglang.scoring.kvzip_lite import ALL_QUERIES

H_KV, GQA, D = 2, 3, 8


def brute_force(q, k, scale, band, lse=None):
    """Loop form of the rule: token j's score = max over query heads of its KV head and over
    queries i >= j + band of softmax_i(j) (normaliser ``lse`` or the causal segment)."""
    hq, n, _ = q.shape
    out = torch.zeros(hq, n, dtype=torch.float64)
    for h in range(hq):
        kh = k[h // GQA].double()
        for i in range(n):
            logits = (kh[: i + 1] @ q[h, i].double()) * scale
            norm = torch.logsumexp(logits, 0) if lse is None else lse[h, i].double()
            probs = torch.exp(logits - norm)
            for j in range(0, i - band + 1):
                out[h, j] = max(out[h, j], probs[j])
    return out.view(H_KV, GQA, n).amax(1)


@pytest.mark.parametrize("band", [0, 3])
@pytest.mark.parametrize("with_lse", [False, True])
def test_scores_equal_the_brute_force_rule(band, with_lse):
    n = 19
    q = torch.randn(H_KV * GQA, n, D)
    k = torch.randn(H_KV, n, D)
    lse = torch.randn(H_KV * GQA, n).abs() + 4.0 if with_lse else None
    scorer = KVzipLiteScorer(local_band=band, max_queries=0, query_block=4)
    got = scorer.score(q, k, 0.4, lse_obs=lse)
    want = brute_force(q, k, 0.4, band, lse)
    assert got.shape == (H_KV, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)
    if band:
        assert got[:, n - band :].abs().max() == 0  # no query far enough away


def test_a_token_one_middle_query_needs_outranks_its_neighbours():
    """SnapKV's last window never looks at token 5; a query in the middle of the segment does."""
    n = 40
    k = 0.01 * torch.randn(H_KV, n, D)
    k[:, 5, 0] = 1.0
    q = torch.zeros(H_KV * GQA, n, D)
    q[:, 20, 0] = 30.0  # query 20 attends to token 5 only
    lite = KVzipLiteScorer(local_band=4, max_queries=0).score(q, k, 1.0)
    snap = get_scorer("snapkv", obs_window=8, kernel_size=1).score(q[:, -8:], k, 1.0)
    assert int(select_kept(lite, 1, 0, 0)[0, 0]) == 5
    assert int(select_kept(snap, 1, 0, 0)[0, 0]) != 5


def test_max_queries_bounds_the_scored_queries():
    scorer = KVzipLiteScorer(max_queries=4)
    slots = scorer.query_slots(10)
    assert slots == sorted(set(slots)) and len(slots) == 4
    assert slots[-1] == 9  # the last query always counts
    assert KVzipLiteScorer(max_queries=0).query_slots(7) == list(range(7))
    # with every query a subset, the subset's scores never exceed the full set's
    q, k = torch.randn(H_KV * GQA, 30, D), torch.randn(H_KV, 30, D)
    full = KVzipLiteScorer(max_queries=0, local_band=0).score(q, k, 0.3)
    part = KVzipLiteScorer(max_queries=6, local_band=0).score(q, k, 0.3)
    assert torch.all(part <= full + 1e-7) and not torch.equal(part, full)


def test_registry_defaults_and_bad_options():
    scorer = get_scorer("kvzip-lite")
    assert isinstance(scorer, KVzipLiteScorer) and scorer.obs_window == ALL_QUERIES
    for bad, field in (
        ({"obs_window": 0}, "obs_window"),
        ({"local_band": -1}, "local_band"),
        ({"kernel_size": 2}, "kernel_size"),
        ({"gqa_reduce": "sum"}, "gqa_reduce"),
    ):
        with pytest.raises(ConfigError, match=field):
            get_scorer("kvzip-lite", **bad)
    with pytest.raises(ConfigError, match="do not fit"):
        scorer.score(torch.randn(5, 4, D), torch.randn(2, 4, D), 1.0)


@pytest.mark.parametrize("share", [0.0, 0.25], ids=["lite", "window-share"])
def test_serving_path_equals_the_per_request_oracle(share):
    """``batch_kept_indices`` (the attention backend's call) with every query of each segment
    (and, under a ``window_share``, the observation window's scores fused in)."""
    lengths = [40, 17, 17, 0, 64]
    gen = torch.Generator().manual_seed(3)
    total = sum(lengths)
    q = torch.randn(total, GQA * H_KV, D, generator=gen)
    k = torch.randn(total, H_KV, D, generator=gen)
    lse = torch.randn(total, GQA * H_KV, generator=gen).abs() + 3.0
    bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    rng = np.random.default_rng(0)
    kept = [[int(rng.integers(1, n + 1)) if n else 1 for _ in range(H_KV)] for n in lengths]
    scorer = KVzipLiteScorer(max_queries=16, query_block=5, window_share=share)
    want = reference_kept_indices(scorer, q, k, lse, bounds, kept, 0.3, 2, 3)
    got = batch_kept_indices(scorer, q, k, lse, bounds, kept, 0.3, 2, 3)
    assert torch.equal(got, want)
    # the per-request oracle scored every query of the segment (not a window)
    start, n = bounds[4], lengths[4]
    scores = scorer.score(
        q[start : start + n].transpose(0, 1),
        k[start : start + n].transpose(0, 1),
        0.3,
        lse_obs=lse[start : start + n].transpose(0, 1),
    )
    for h in range(H_KV):
        assert got[4, h, : kept[4][h]].tolist() == select_kept(scores[h], kept[4][h], 2, 3).tolist()


# --- kvpress KVzipPress as the oracle, on the real SmolLM2 -------------------------------------


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    # Imported here: importing kvpress patches transformers' attention table. A missing kvpress
    # fails these tests (ImportError), never skips them.
    import kvpress  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tangram_sglang.calibrate.data import load_samples

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(
        smollm2_path, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    sample = load_samples("ruler-squad", tok, 1, 192, 192, seed=1)[0]
    return model, sample.input_ids


def _kvzip_run(model, ids, on_replay=None):
    """kvpress KVzipPress on ``ids``: its per-layer scores ``[L, H_kv, n]``. ``on_replay(module,
    queries, keys, scores)`` sees each layer's reconstruction queries ``[Hq, q_len, D]`` (post-
    RoPE), the keys KVzip scores against ``[H_kv, sink + chunk + q_len, D]`` and kvpress's own
    scores of the chunk ``[H_kv, chunk]``."""
    import kvpress
    from kvpress.utils import get_prerope_query_states
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    class Observed(kvpress.KVzipPress):
        def score_kvzip(self, module, hidden_states, keys, values, attentions, kwargs):
            out = super().score_kvzip(module, hidden_states, keys, values, attentions, kwargs)
            if on_replay is not None:
                q_len = hidden_states.shape[1]
                sink = min(self.n_sink, self.start_idx)
                q = get_prerope_query_states(module, hidden_states)
                cos, sin = kwargs["position_embeddings"]
                q, _ = apply_rotary_pos_emb(q, q, cos, sin)
                sub = torch.cat(
                    [
                        keys[:, :, :sink],
                        keys[:, :, self.start_idx : self.end_idx],
                        keys[:, :, -q_len:],
                    ],
                    dim=2,
                )
                theirs = self.score_val[module.layer_idx][0, :, self.start_idx : self.end_idx]
                on_replay(module, q[0], sub[0], theirs, sink)
            return out

        def compress_post(self, model):
            self.grabbed = self.score_val[:, 0].float().clone()

    press = Observed(compression_ratio=0.5)
    n = len(ids)
    pos = torch.arange(n)
    with torch.inference_mode(), press(model):
        model.model(
            input_ids=torch.tensor([ids]),
            past_key_values=DynamicCache(config=model.config),
            use_cache=True,
            cache_position=pos,
            position_ids=pos[None],
        )
    return press.grabbed


def test_scorer_reproduces_kvpress_kvzip_on_the_reconstruction_pass(smollm2):
    """KVzip's rule is KVzip-lite's rule applied to the replay's queries: equal scores per layer."""
    model, ids = smollm2
    scorer = KVzipLiteScorer(local_band=0, max_queries=0)
    seen = []

    def check(module, q, keys, theirs, sink):
        ours = scorer.score(q.float(), keys.float(), 1.0 / math.sqrt(q.shape[-1]))
        ours = ours[:, sink : sink + theirs.shape[-1]]
        torch.testing.assert_close(ours, theirs.float(), rtol=1e-4, atol=1e-6)
        seen.append(module.layer_idx)

    _kvzip_run(model, ids, check)
    assert sorted(seen) == list(range(model.config.num_hidden_layers))


def _overlap(scores, oracle, ratio):
    """Share of KVzip's kept (layer, head, token) triples that ``scores`` keeps too."""
    k = max(1, int(oracle.shape[-1] * ratio))
    ours = select_kept(torch.as_tensor(scores), k, 4, 32)
    theirs = select_kept(oracle, k, 4, 32)
    mask = lambda idx: torch.zeros_like(oracle, dtype=torch.bool).scatter(-1, idx, True)  # noqa: E731
    return float((mask(ours) & mask(theirs)).sum() / mask(theirs).sum())


@pytest.mark.slow  # three SmolLM2 forwards + KVzip's replay: ~20 s on a quiet 2-core CPU
def test_same_pass_selection_is_closer_to_kvzip_than_snapkv(smollm2):
    """The same-pass scores keep more of what KVzip keeps than SnapKV's window scores do."""
    from tangram_sglang.calibrate.observe import ScoreObserver

    model, ids = smollm2
    oracle = _kvzip_run(model, ids)
    lite = ScoreObserver(model, get_scorer("kvzip-lite")).scores(ids)
    snap = ScoreObserver(model, get_scorer("snapkv", obs_window=32, kernel_size=5)).scores(ids)
    for ratio in (0.25, 0.5):
        ours, window = _overlap(lite, oracle, ratio), _overlap(snap, oracle, ratio)
        assert ours > window + 0.02, (ratio, ours, window)


def test_serving_path_builds_no_snapkv_buckets():
    """The per-batch plan holds no SnapKV length bucket for kvzip-lite: its ``masked`` tensor
    is ``[b, 1, W, N]`` bools with ``W = n`` under every-query scoring (256 MiB at n = 16384,
    kept in the plan cache on the device), and the kvzip-lite path never reads it."""
    from tangram_sglang.backend import compress

    n = 300
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(n, GQA * H_KV, D, generator=gen)
    k = torch.randn(n, H_KV, D, generator=gen)
    lse = torch.randn(n, GQA * H_KV, generator=gen).abs() + 3.0
    compress._PLANS.clear()
    scorer = KVzipLiteScorer(max_queries=16)
    got = batch_kept_indices(scorer, q, k, lse, [0, n], [[40] * H_KV], 0.3, 2, 3)
    assert torch.equal(
        got, reference_kept_indices(scorer, q, k, lse, [0, n], [[40] * H_KV], 0.3, 2, 3)
    )
    assert compress._PLANS and all(not plan.buckets for plan in compress._PLANS.values())


def test_evenly_spaced_slots_are_the_loop_form():
    """The closed form (``slot_table``, one array per batch) equals the rule written as a loop:
    every query under the bound, else ``w - 1 - floor(i * (w / max_queries))`` with a float64
    quotient, ascending (bounds 14, 48, 100: cases where the float rounding differs from
    integer division, e.g. w = 122, bound 14, i = 7: floor 60 not 61, slot 61 not 60)."""
    from tangram_sglang.scoring.kvzip_lite import evenly_spaced_slots

    def loop(w, bound):
        if bound == 0 or bound >= w:
            return list(range(w))
        return sorted(w - 1 - math.floor(i * (w / bound)) for i in range(bound))

    from tangram_sglang.scoring.kvzip_lite import slot_table

    for bound in (0, 1, 3, 7, 14, 24, 48, 100, 1024):
        for w in [*range(1, 300), *range(1000, 20000, 997)]:
            assert evenly_spaced_slots(w, bound) == loop(w, bound), (w, bound)
        ws = np.arange(0, 300)  # the batched form, one row per w (0: a row scoring none)
        count, table = slot_table(ws, bound)
        for w, c, row in zip(ws.tolist(), count.tolist(), table, strict=True):
            assert row[row.shape[0] - c :].tolist() == (loop(w, bound) if w else [])
    assert 61 in evenly_spaced_slots(122, 14) and 60 not in evenly_spaced_slots(122, 14)
    with pytest.raises(ConfigError, match="max_queries=-1"):
        slot_table(np.array([5]), -1)
