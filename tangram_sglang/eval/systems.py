"""The systems compared: SGLang servers (full KV, Tangram) and kvpress presses in transformers.

Owns how one sample's token ids (``tasks.Conversation``: a context, then per-turn prompts that
extend it) become greedy output ids for each system, and the budget match between Tangram and
the presses. Samples come from ``tasks``; scoring from ``scoring``. Protocols (``tasks.PROTOCOLS``):
query-agnostic (default), the context is compressed before any question exists, the questions are
appended uncompressed (servers: the context is its own request and later requests reuse it from
the radix tree; kvpress: the press runs on the context prefill only); query-aware (SnapKV), the
whole first prompt is the compressed part (``tasks.for_protocol``), later turns extend it.

* ``full``: stock SGLang (``SGLangServer`` without ``--tangram``), ``POST /generate`` with the
  prompt ids, ``temperature 0``; radix cache on (multi-turn turns reuse the uncompressed prefix).
* ``tangram``: the ``--tangram`` SGLang server with a static profile (``tangram_profile``: the
  shipped matching-ratio Ada-SnapKV profile rescaled to the ratio); radix reuse on, so every
  question extends the compressed context segment (``cached_tokens`` reported and checked). A
  question segment longer than sink + window (36 tokens) is itself compressed (Tangram compresses
  every extend segment); the presses never compress the questions.
* ``dynamic-ada-snapkv``: NVIDIA kvpress 0.5.5 ``AdaKVPress(SnapKVPress)``, per request and
  per layer (heads of a layer compete for the layer's budget; it masks, never frees: the paper's
  "w/o Tangram" reference, Tangram arXiv 2606.06302 §5.2).
* ``uniform-snapkv``: kvpress ``SnapKVPress``: every head keeps the same count.
* ``kvzip``: kvpress ``KVzipPress`` (query-agnostic by context reconstruction: after the context
  prefill, extra forwards of "Repeat the previous context." + the context score every KV pair by
  the largest attention a reconstruction query pays it; one budget over all layers and heads).
  It needs those extra forwards, so it gets its own prefill (:meth:`KvpressRunner._prefill_kvzip`).
* ``kvzip-budgets``: KVzip's scores (the same reconstruction forwards) with Tangram's static
  allocation: each KV head keeps its group's ``kept_len`` of the context from the shipped
  ``kvzip-lite`` profile at the ratio, by KVzip's score, with Tangram's sinks and recent window
  (:func:`profile_budget_kvzip_press`). Beside ``kvzip`` (one budget over every layer and head
  per request) and ``tangram-kvzip-lite`` (same budgets, same-pass scores) it tells which of
  the two, the scores or the allocation, a gap to KVzip comes from.
* ``kvzip-group-alloc``: KVzip's scores with a per-request allocation inside the same profile's
  total (:func:`~tangram_sglang.eval.allocation.group_allocation`: the request keeps as many
  entries as the static budgets, and the head groups trade them by the request's scores, every
  head of a group keeping the same count: what a Tangram server could do without changing its
  footprint).
* ``kvzip-head-alloc``: the same, head by head (every KV head its own count: the granularity
  of KVzip's own allocation, which pages of one head each would allow).
* ``kvzip-layer-head-alloc``: the same head by head, but each layer splits only its own
  static total among its heads (the split a server could make layer by layer in the forward,
  before later layers have scored).
* ``kvzip-lite-budgets`` / ``kvzip-lite-group-alloc`` / ``kvzip-lite-head-alloc``: the
  profile's own same-pass scorer (``kvzip-lite``) run on the transformers model
  (``calibrate.observe.ScoreObserver``: the post-RoPE queries and keys of the context prefill),
  with the static budgets (the twin of ``tangram-kvzip-lite``'s selection, outside the server)
  or with the per-request allocation (per group, per head).
* ``kvzip-gate-budgets``: the same with the ``kvzip-gate`` profile's gate (KVzip's scores
  predicted from each token's key and value) and its static budgets: the twin of
  ``tangram-kvzip-gate``'s selection. Either twin reads its profile's scorer options, the
  ``window_share`` union with the observation window included (docs/scorers.md).
* ``tangram-kvzip-lite``: the ``--tangram`` server with the shipped ``kvzip-lite`` profile (the
  same-pass query-agnostic scorer, ``scoring/kvzip_lite.py``), rescaled to the ratio.
* ``tangram-kvzip-replay``: the same with the shipped ``kvzip-replay`` profile (the segment's
  own queries at KVzip's replay positions, ``scoring/replay.py``).
* ``tangram-kvzip-gate``: the same with the shipped ``kvzip-gate`` profile (KVzip's scores
  predicted by a per-head linear gate on each token's key and value, ``scoring/kvzip_gate.py``).
* ``tangram-kvzip``: the same with the shipped ``kvzip`` profile (KVzip's own scores: the
  server replays each compressed segment in its extend forward, ``scoring/kvzip.py``).
* ``expected-attention`` / ``dynamic-ada-expected-attention``: kvpress
  ``ExpectedAttentionPress`` (query-agnostic in the same pass: each key scored by the attention
  the mean and covariance of the context's pre-RoPE queries, rotated to the next 512 positions,
  would pay it, times the value's norm; Devoto et al. 2025), every head the same count, or
  inside ``AdaKVPress`` (heads of a layer compete for the layer's budget). Diagnostics: is a
  same-pass query-agnostic score near KVzip's on later questions?
* ``full-hf``: the same transformers model without a press (a diagnostic: HF vs SGLang numerics).

kvpress on transformers 5.12.1 (checked 2026-11-30): ``with press(model): model.generate(...)``
fails (``KeyError: 'cache_position'``: 5.12's ``generate`` no longer passes it to attention
layers), but kvpress's hooks and attention patch work when the forward gets ``cache_position``
(``calibrate/crosscheck.py`` does the same). So :class:`KvpressRunner` runs its own greedy loop
(context prefill, then each turn's new tokens as one forward, then one token per step, explicit
logical ``position_ids``); with no press it reproduces ``model.generate``'s greedy ids. One
context prefill serves every press: the presses only
change the cache after each layer's attention (``BasePress.forward_hook``), never the prefill's
hidden states, so the hook below calls each press's own ``compress`` on a copy of the layer's K/V.

Budget match: per context of ``n`` tokens, Tangram keeps ``sum_heads kept_len(n, r_group(head))``
entries (sink, recent window and group padding included); the presses get
``compression_ratio = 1 - that / (num_heads * n)``, so all compressed systems keep the same
number of KV entries of the context.
"""

from __future__ import annotations

import copy
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import numpy as np
import requests

from tangram_sglang.errors import ConfigError, TangramError
from tangram_sglang.eval.allocation import check_scores, group_allocation
from tangram_sglang.mem.reservation import segment_kept_lens
from tangram_sglang.profile import BudgetProfile

# diagnostic press systems left out of the default run
DIAGNOSTIC_PRESS_SYSTEMS = ("expected-attention", "dynamic-ada-expected-attention")
PRESS_SYSTEMS = (
    "dynamic-ada-snapkv",
    "uniform-snapkv",
    "kvzip",
    "kvzip-budgets",
    "kvzip-group-alloc",
    "kvzip-head-alloc",
    "kvzip-layer-head-alloc",
    "kvzip-lite-budgets",
    "kvzip-lite-group-alloc",
    "kvzip-lite-head-alloc",
    "kvzip-gate-budgets",
    *DIAGNOSTIC_PRESS_SYSTEMS,
)
# press systems whose per-head budgets come from a Tangram profile: system -> its scorer
PROFILE_BUDGET_SYSTEMS = {
    "kvzip-budgets": "kvzip-lite",
    "kvzip-group-alloc": "kvzip-lite",
    "kvzip-head-alloc": "kvzip-lite",
    "kvzip-layer-head-alloc": "kvzip-lite",
    "kvzip-lite-budgets": "kvzip-lite",
    "kvzip-lite-group-alloc": "kvzip-lite",
    "kvzip-lite-head-alloc": "kvzip-lite",
    "kvzip-gate-budgets": "kvzip-gate",
}
ALLOCATIONS = (
    "static",
    "group",
    "head",
    "layer-head",
)  # a profile-budget system's (profile_kept_counts)
# of those systems, the ones that split the profile's total per request (eval.allocation):
# system -> allocation (the rest are "static"); and the ones scored by the profile's own
# same-pass scorer (ObservedScorePress) instead of KVzip's
ALLOCATION_OF = {
    "kvzip-group-alloc": "group",
    "kvzip-head-alloc": "head",
    "kvzip-layer-head-alloc": "layer-head",
    "kvzip-lite-group-alloc": "group",
    "kvzip-lite-head-alloc": "head",
}
OBSERVED_SCORE_SYSTEMS = (
    "kvzip-lite-budgets",
    "kvzip-lite-group-alloc",
    "kvzip-lite-head-alloc",
    "kvzip-gate-budgets",
)
# Tangram systems: system name -> the scorer of its shipped profile (``<scorer>-r<ratio>.json``)
# Tangram systems on the segment grid (``TANGRAM_GRID_SEGMENTS=1``, cells of ``--grid-cell``
# tokens): every whole cell is compressed on its own, before any question (query-agnostic).
GRID_SYSTEMS = {"tangram-grid": "ada-snapkv", "tangram-kvzip-lite-grid": "kvzip-lite"}
TANGRAM_SYSTEMS = {
    "tangram": "ada-snapkv",
    "tangram-kvzip-lite": "kvzip-lite",
    "tangram-kvzip-replay": "kvzip-replay",
    "tangram-kvzip-gate": "kvzip-gate",
    "tangram-kvzip": "kvzip",
    **GRID_SYSTEMS,
}
GRID_CELL_TOKENS = 256  # default cell: a 1k-token CPU document spans whole cells
# model dtype per --device, for the transformers side and the SGLang servers alike (cpu: the CPU
# engine's float32; cuda: bfloat16, the Qwen2.5 / SmolLM2 training dtype; SGLang's "auto" would
# pick float16 for the float32-saved conversions)
DEVICE_DTYPES = {"cpu": "float32", "cuda": "bfloat16"}
SNAPKV_WINDOW = 32  # kvpress SnapKV observation window = the profiles' scorer window
SNAPKV_KERNEL = 5  # avg-pool kernel, as in calibration/README.md
ADAKV_ALPHA = 0.2  # AdaKV safeguard (kvpress default; the profiles' calibration value)


def tangram_kept_fraction(profile: BudgetProfile, num_tokens: int, grid_cell: int = 0) -> float:
    """Share of full KV that Tangram keeps for ``num_tokens`` tokens.

    Without a grid (``grid_cell`` 0) the tokens are one segment; on the segment grid each whole
    cell of ``grid_cell`` tokens is one segment and the tokens after the last whole cell are kept
    whole (``mem.reservation.segment_kept_lens``, docs/design.md §5.1): fewer tokens than one
    cell are all kept (1.0). Each KV head keeps its group's ``kept_len`` of each segment
    (Tangram arXiv 2606.06302 §4.1, docs/design.md §2).
    """
    if not grid_cell:
        group_len = np.array(profile.group_kept_lens(num_tokens), dtype=np.float64)
    else:  # the serving rule itself, segment by segment: whole cells, then the tail
        cells = num_tokens // grid_cell
        cuts = [(k * grid_cell, grid_cell) for k in range(cells)]
        if num_tokens > cells * grid_cell:
            cuts.append((cells * grid_cell, num_tokens - cells * grid_cell))
        group_len = sum(
            segment_kept_lens(profile, start, n, grid_cell).astype(np.float64) for start, n in cuts
        )
    per_head = group_len[profile.grouping.cluster_of]
    return float(per_head.mean() / num_tokens)


def tangram_profile(shipped: BudgetProfile, ratio: float) -> BudgetProfile:
    """The shipped profile rescaled so that the mean per-head ratio is ``ratio``."""
    return shipped.rescaled(ratio)


class ServerClient:
    """Greedy ``/generate`` calls against a running SGLang server.

    Args:
        base_url: ``http://host:port``.
        timeout_s: per request (seconds).
    """

    def __init__(self, base_url: str, timeout_s: float = 1800.0) -> None:
        self.base_url = base_url
        self.timeout_s = timeout_s

    def generate(self, input_ids: list[int], max_new_tokens: int) -> tuple[list[int], int]:
        """Output ids (greedy) and ``cached_tokens`` (prompt tokens served from the radix cache).

        Raises:
            TangramError: HTTP error or a reply without ``output_ids``.
        """
        params = {"temperature": 0, "max_new_tokens": max_new_tokens}
        resp = requests.post(
            f"{self.base_url}/generate",
            json={"input_ids": input_ids, "sampling_params": params},
            timeout=self.timeout_s,
        )
        try:
            body = resp.json()
        except ValueError:
            body = {}
        if resp.status_code != 200 or not isinstance(body, dict) or "output_ids" not in body:
            raise TangramError(f"/generate answered {resp.status_code}: {resp.text[:500]}")
        return list(body["output_ids"]), int(body.get("meta_info", {}).get("cached_tokens", 0))


class KvpressRunner:
    """One transformers model; greedy decoding of a prompt under several kvpress presses at once.

    Args:
        model_path: HF folder of the model.
        eos_ids: token ids that end generation (the model's generation config).
        threads: torch CPU threads (None: torch's default).
        device: ``cpu`` (float32) or ``cuda`` (bfloat16, the first GPU); :data:`DEVICE_DTYPES`.

    Raises:
        ImportError: kvpress is not installed (``scripts/install_calibrate_deps.sh``).
    """

    def __init__(
        self, model_path: str, eos_ids: set[int], threads: int | None = None, device: str = "cpu"
    ) -> None:
        import kvpress  # noqa: F401  (patches transformers' attention table: needed for AdaKV)
        import torch
        from transformers import AutoModelForCausalLM

        if threads:
            torch.set_num_threads(threads)
        self.device = torch.device(device)
        self.model = (
            AutoModelForCausalLM.from_pretrained(
                model_path, dtype=getattr(torch, DEVICE_DTYPES[device]), attn_implementation="sdpa"
            )
            .to(self.device)
            .eval()
        )
        for layer in self.model.model.layers:
            # what kvpress's own ``press(model)`` sets: Expected Attention rotates its query
            # statistics with the layer's rotary embedding (transformers 5 keeps it on the model)
            layer.self_attn.rotary_emb = self.model.model.rotary_emb
        self.eos_ids = eos_ids
        # press name -> [layer][kv_head] context entries kept by the last ``generate`` (tokens)
        self.kept_per_head: dict[Any, list[list[int]]] = {}
        # scorer (or the gate's (name, id(profile))) -> (calibrate.observe.ScoreObserver, profile)
        self._observers: dict[Any, Any] = {}

    @staticmethod
    def make_press(
        system: str, compression_ratio: float, profile: BudgetProfile | None = None
    ) -> Any:
        """The kvpress press of one system at ``compression_ratio`` (share of KV removed);
        ``profile``: the per-head budgets of a :data:`PROFILE_BUDGET_SYSTEMS` system.

        Raises:
            TangramError: an unknown system, or a budget system without its profile.
        """
        import kvpress

        if system in PROFILE_BUDGET_SYSTEMS:
            if profile is None:
                raise TangramError(f"press system {system!r} needs the profile of its budgets")
            allocation = ALLOCATION_OF.get(system, "static")
            if system in OBSERVED_SCORE_SYSTEMS:
                from tangram_sglang.backend.state import build_scorer

                return ObservedScorePress(build_scorer(profile), profile, allocation)
            return profile_budget_kvzip_press(profile, compression_ratio, allocation)

        snap = kvpress.SnapKVPress(
            compression_ratio=compression_ratio,
            window_size=SNAPKV_WINDOW,
            kernel_size=SNAPKV_KERNEL,
        )
        if system == "uniform-snapkv":
            return snap
        if system == "dynamic-ada-snapkv":
            return kvpress.AdaKVPress(snap, alpha_safeguard=ADAKV_ALPHA)
        if system == "kvzip":
            return kvpress.KVzipPress(compression_ratio=compression_ratio)
        if system in DIAGNOSTIC_PRESS_SYSTEMS:
            expected = kvpress.ExpectedAttentionPress(compression_ratio=compression_ratio)
            if system == "expected-attention":
                return expected
            return kvpress.AdaKVPress(expected, alpha_safeguard=ADAKV_ALPHA)
        raise TangramError(f"unknown press system {system!r}; use one of {PRESS_SYSTEMS}")

    def generate(
        self,
        context_ids: list[int],
        turn_ids: list[list[int]],
        presses: dict[Any, Any],
        max_new_tokens: int,
    ) -> dict[Any, list[list[int]]]:
        """Greedy output ids per press name (``None`` press = full KV) and turn.

        One shared prefill of ``context_ids``, each press compresses its K/V; then for every turn
        the rest of that turn's prompt (questions, earlier gold answers, chat template) is
        prefilled uncompressed on a copy of the compressed cache, and decoding continues from it.
        Query-agnostic protocol (kvpress's pipeline with ``question=``): ``context_ids`` is the
        context alone. Query-aware (SnapKV, ``tasks.for_protocol``): ``context_ids`` is the whole
        first prompt; turn 0 adds nothing, its first token comes from the prefill's logits (full
        attention, as in kvpress's pipeline and SnapKV), the next ones from the compressed cache.

        Args:
            context_ids: the compressed part (tokens), a prefix of every ``turn_ids`` entry.
            turn_ids: each turn's full prompt (tokens).
            presses: name -> kvpress press, :class:`ObservedScorePress`, or None (full KV).
            max_new_tokens: decode steps at most per turn; stops at an eos id.

        Returns:
            name -> one list of output ids per turn.

        Raises:
            TangramError: a turn's prompt does not start with ``context_ids``.
        """
        import torch

        n = len(context_ids)
        if any(ids[:n] != context_ids or len(ids) < n for ids in turn_ids):
            raise TangramError("every turn's prompt must extend the context ids (or equal them)")
        with torch.inference_mode():
            prompt = torch.tensor([context_ids], device=self.device)
            kvzip = {name: p for name, p in presses.items() if _is_kvzip(p)}
            observed = {name: p for name, p in presses.items() if isinstance(p, ObservedScorePress)}
            same_pass = {  # an observed-score system starts from the full K/V, then masks
                name: None if name in observed else p
                for name, p in presses.items()
                if name not in kvzip
            }
            logits, caches, masks = self._prefill(prompt, same_pass)
            scored: dict[Any, np.ndarray] = {}  # scorer -> its scores of this context
            for name, press in observed.items():
                masks[name] = self._observed_masks(context_ids, name, press, scored)
            for name, press in kvzip.items():
                logits, caches[name], masks[name] = self._prefill_kvzip(prompt, name, press)
            return {
                name: [
                    self._answer(
                        copy.deepcopy(caches[name]), masks[name], ids, n, max_new_tokens, logits
                    )
                    for ids in turn_ids
                ]
                for name in presses
            }

    def _prefill(self, ids: Any, presses: dict[str, Any]) -> tuple[Any, dict, dict]:
        """One forward of ``ids`` ``[1, n]``; returns the last position's logits ``[1, vocab]``,
        and per press the compressed cache and AdaKV's masked indices per layer."""
        import torch
        from transformers import DynamicCache

        layers = self.model.model.layers
        cache = DynamicCache(config=self.model.config)
        kept: dict[str, dict[int, tuple]] = {name: {} for name in presses}
        self.kept_per_head = {name: [[]] * len(layers) for name in presses}
        masks: dict[str, dict[int, Any]] = {name: {} for name in presses}

        def fan_out(module, args, kwargs, output):  # after the layer's attention: full K/V
            layer = cache.layers[module.layer_idx]
            for name, press in presses.items():
                keys, values = layer.keys.clone(), layer.values.clone()
                if press is not None:
                    module.masked_key_indices = None
                    keys, values = press.compress(
                        module, kwargs["hidden_states"], keys, values, output[1], kwargs
                    )
                    masks[name][module.layer_idx] = getattr(module, "masked_key_indices", None)
                    module.masked_key_indices = None
                kept[name][module.layer_idx] = (keys, values)
                self.kept_per_head[name][module.layer_idx] = _kept_counts(
                    keys.shape[1], keys.shape[2], masks[name].get(module.layer_idx)
                )
            return output

        n = ids.shape[1]
        with ExitStack() as stack:
            for press in presses.values():
                if press is not None:
                    press.post_init_from_model(self.model)
            for layer in layers:
                handle = layer.self_attn.register_forward_hook(fan_out, with_kwargs=True)
                stack.callback(handle.remove)
            pos = torch.arange(n, device=self.device)
            # the last position's logits: turn 0's first token in the query-aware protocol
            logits = self.model(
                input_ids=ids,
                past_key_values=cache,
                use_cache=True,
                cache_position=pos,
                position_ids=pos[None],
                logits_to_keep=1,
            ).logits[:, -1]
        caches = {}
        for name in presses:
            c = copy.deepcopy(cache)
            for i, layer in enumerate(c.layers):
                layer.keys, layer.values = kept[name][i]
            caches[name] = c
        return logits, caches, masks

    def _observed_masks(
        self,
        context_ids: list[int],
        name: Any,
        press: ObservedScorePress,
        scored: dict[Any, np.ndarray] | None = None,
    ) -> dict[int, tuple]:
        """The evicted (head, token) pairs per layer of an observed-score system: its scorer on
        a forward of the context (``ScoreObserver``), then :func:`profile_kept_counts`; records the
        kept entries per head in ``kept_per_head[name]``.

        Args:
            context_ids: the context (tokens).
            name: the system's key in ``kept_per_head``.
            press: the system.
            scored: scores already computed for this context, per scorer (float32
                ``[layers, kv_heads, n]``); this call adds its own, so presses of one scorer
                (several ratios or allocations) share one scoring forward.

        Returns:
            layer -> kvpress's ``masked_key_indices`` (:func:`evicted_indices`).
        """
        from tangram_sglang.calibrate.observe import ScoreObserver
        from tangram_sglang.scoring.kvzip_gate import is_token_scorer

        # one observer per scorer (it registers an attention function); kvzip-lite's scorers
        # are frozen dataclasses of options, equal and hashing alike when their options are;
        # the gate's (weights, eq=False) hashes by identity and is built anew per sample, so it
        # is keyed by its profile (built once per run and ratio), which the entry holds alive
        # so that its id is not reused by another profile
        scored = {} if scored is None else scored
        key = (press.scorer.name, id(press.profile)) if is_token_scorer(press.scorer) else None
        key = key or press.scorer
        if key not in scored:
            if key not in self._observers:
                self._observers[key] = (ScoreObserver(self.model, press.scorer), press.profile)
            scored[key] = self._observers[key][0].scores(context_ids)
        scores = scored[key]
        kept = profile_kept_counts(press.profile, scores, press.allocation)
        self.kept_per_head[name] = kept.tolist()
        return {
            layer: evicted_indices(press.profile, scores[layer], kept[layer], self.device)
            for layer in range(kept.shape[0])
        }

    def _prefill_kvzip(self, ids: Any, name: Any, press: Any) -> tuple[Any, Any, dict]:
        """KVzip's own prefill of ``ids`` ``[1, n]``: the context forward, then kvpress's
        reconstruction forwards, which leave the context's K/V in the cache and the evicted
        (head, token) pairs in each attention module's ``masked_key_indices``.

        Returns the last position's logits ``[1, vocab]``, the cache and the masks per layer;
        records the kept entries per head in ``kept_per_head[name]``.
        """
        import torch
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        n = ids.shape[1]
        pos = torch.arange(n, device=self.device)
        attns = [layer.self_attn for layer in self.model.model.layers]
        try:
            with press(self.model):
                logits = self.model(
                    input_ids=ids,
                    past_key_values=cache,
                    use_cache=True,
                    cache_position=pos,
                    position_ids=pos[None],
                    logits_to_keep=1,
                ).logits[:, -1]
            masks = {i: getattr(attn, "masked_key_indices", None) for i, attn in enumerate(attns)}
        finally:
            for attn in attns:
                attn.masked_key_indices = None
        self.kept_per_head[name] = [
            _kept_counts(layer.keys.shape[1], layer.keys.shape[2], masks.get(i))
            for i, layer in enumerate(cache.layers)
        ]
        return logits, cache, masks

    def _answer(
        self, cache, masks: dict, ids: list[int], n: int, max_new_tokens: int, prefill_logits
    ) -> list[int]:
        """Prefill ``ids[n:]`` uncompressed on the (compressed) context cache, then greedy decode.

        Positions are logical (``n`` onwards, whatever the cache kept); transformers 5.12 builds
        the causal mask from the cache's stored length, so the new tokens are causal among
        themselves and see every kept context entry. When ``ids`` adds nothing (query-aware turn
        0), the first token is the argmax of ``prefill_logits`` (``[1, vocab]``).
        """
        import torch

        attns = [layer.self_attn for layer in self.model.model.layers]
        out: list[int] = []
        step_ids, pos = ids[n:], torch.arange(n, len(ids), device=self.device)
        logits = None if step_ids else prefill_logits
        try:
            for i, attn in enumerate(attns):  # AdaKV: kvpress's attention patch masks these
                attn.masked_key_indices = masks.get(i)
            for step in range(max_new_tokens):
                if logits is None:
                    logits = self.model(
                        input_ids=torch.tensor([step_ids], device=self.device),
                        past_key_values=cache,
                        use_cache=True,
                        cache_position=pos,
                        position_ids=pos[None],
                        logits_to_keep=1,
                    ).logits[:, -1]
                token = int(logits.argmax(-1))
                logits = None
                out.append(token)
                if token in self.eos_ids:
                    break
                step_ids, pos = [token], torch.tensor([len(ids) + step], device=self.device)
        finally:
            for attn in attns:
                attn.masked_key_indices = None
        return out


def _is_kvzip(press: Any) -> bool:
    """Whether ``press`` is kvpress's ``KVzipPress`` or a subclass (it needs its own prefill)."""
    return any(cls.__name__ == "KVzipPress" for cls in type(press).__mro__)


@dataclass(frozen=True, slots=True, eq=False)
class ObservedScorePress:
    """A Tangram scorer's selection on the transformers model, outside the server.

    The runner prefills the context with the full K/V, runs ``scorer`` on the same context
    (``calibrate.observe.ScoreObserver``), and masks what each head does not keep (kvpress's
    attention patch reads ``masked_key_indices``, as for AdaKV).

    Attributes:
        scorer: the profile's scorer (``backend.state.build_scorer``).
        profile: the budgets, sinks and recent window.
        allocation: ``"static"`` (each head keeps its group's ``kept_len``), ``"group"``,
            ``"head"`` or ``"layer-head"``
            (:func:`~tangram_sglang.eval.allocation.group_allocation`).
    """

    scorer: Any
    profile: BudgetProfile
    allocation: str

    def __post_init__(self) -> None:
        check_allocation(self.allocation)
        from tangram_sglang.scoring.snapkv import window_share_of

        if self.allocation != "static" and window_share_of(self.scorer):
            raise ConfigError(
                f"allocation={self.allocation!r} splits the budget by comparing scores across "
                f"heads, but {self.scorer.name}'s window_share={self.scorer.window_share} makes "
                "them per-head rank fractions; use the static budgets (the *-budgets system) "
                "or a profile without window_share"
            )


def check_allocation(allocation: str) -> None:
    """Raises TangramError unless ``allocation`` is one of :data:`ALLOCATIONS`."""
    if allocation not in ALLOCATIONS:
        raise TangramError(f"allocation={allocation!r} is unknown; use one of {ALLOCATIONS}")


def profile_kept_counts(profile: BudgetProfile, scores: np.ndarray, allocation: str) -> np.ndarray:
    """Kept entries per KV head of a context scored ``[layers, kv_heads, n]`` (float).

    ``static``: the profile's ``group_kept_array(n)`` of each head's group; ``group``,
    ``head`` and ``layer-head``: :func:`~tangram_sglang.eval.allocation.group_allocation` (the
    same total, per request, one count per group or per head; ``layer-head``: each layer's own
    total among its heads).

    Returns:
        int64 ``[layers, kv_heads]`` (tokens).

    Raises:
        TangramError: an unknown ``allocation``, or scores that are not 3-D with the
            profile's ``[layers, kv_heads]`` (``allocation.check_scores``).
    """
    check_allocation(allocation)
    if allocation != "static":
        return group_allocation(
            scores,
            profile,
            per_head=allocation in ("head", "layer-head"),
            per_layer=allocation == "layer-head",
        )
    n = check_scores(scores, profile).shape[2]
    cluster = np.asarray(profile.grouping.cluster_of)
    return profile.group_kept_array(n).astype(np.int64)[cluster]


def evicted_indices(profile: BudgetProfile, scores: Any, kept: np.ndarray, device: Any) -> tuple:
    """kvpress's ``masked_key_indices`` of one layer: the (head, token) pairs not kept.

    Each head keeps its ``kept[h]`` best by :func:`~tangram_sglang.scoring.select.select_kept`
    (sinks and recent window first, as the server does).

    Args:
        profile: the sinks and recent window.
        scores: float ``[kv_heads, n]``, a numpy array (or a CPU float tensor).
        kept: int ``[kv_heads]`` tokens each head keeps (``1 <= kept[h] <= n``).
        device: where the indices go (the model's: kvpress indexes the keys with them).

    Returns:
        ``(batch, head, token)``: three int64 ``[num_evicted]`` tensors on ``device``, batch 0.

    Raises:
        ConfigError: a ``kept[h]`` outside ``[1, n]`` (``select_kept``).
    """
    import torch

    from tangram_sglang.scoring.select import select_kept

    scores = torch.as_tensor(np.asarray(scores, dtype=np.float32))
    num_kv_heads, n = scores.shape
    evicted = torch.ones(num_kv_heads, n, dtype=torch.bool)
    for head in range(num_kv_heads):
        idx = select_kept(
            scores[head : head + 1], int(kept[head]), profile.sink_tokens, profile.recent_window
        )
        evicted[head, idx[0]] = False
    heads, seq = evicted.nonzero(as_tuple=True)
    heads, seq = heads.to(device), seq.to(device)
    return torch.zeros_like(heads), heads, seq


def profile_budget_kvzip_press(
    profile: BudgetProfile, compression_ratio: float, allocation: str = "static"
) -> Any:
    """kvpress's ``KVzipPress`` scores with a Tangram profile's per-head budgets.

    KVzip's reconstruction forwards score every (layer, KV head, token) of the context as usual;
    then, instead of one top-k over all of them, KV head h of layer l keeps
    ``profile.group_kept_array(n)[cluster_of[l][h]]`` tokens (``allocation="static"``; ``n`` =
    context tokens: the footprint Tangram's server holds for that segment) or its group's share
    of the same total by the request's scores (``"group"``, or per head: ``"head"``, or per
    head within each layer's own total: ``"layer-head"``;
    :func:`~tangram_sglang.eval.allocation.group_allocation`), chosen by
    :func:`~tangram_sglang.scoring.select.select_kept` on KVzip's scores (the profile's sinks
    and recent window kept first, as the server does).

    Args:
        profile: the budgets (a shipped profile rescaled to the ratio).
        compression_ratio: kvpress's share removed, > 0 (KVzip runs its reconstruction only
            then); the kept counts come from ``profile``, not from it.
        allocation: one of :data:`ALLOCATIONS`.

    Returns:
        A ``KVzipPress`` instance whose ``compress_post`` applies the profile's budgets.

    Raises:
        TangramError: an unknown ``allocation``.

    Source: kvpress 0.5.5 ``presses/kvzip_press.py`` (``compress_post``: evicted pairs go in
    each attention module's ``masked_key_indices``); Tangram arXiv 2606.06302 §4.1.
    """
    import kvpress

    check_allocation(allocation)

    class ProfileBudgetKVzipPress(kvpress.KVzipPress):
        def compress_post(self, model: Any) -> None:
            scores = self.score_val[:, 0].detach().float().cpu().numpy()  # [num_layers, H_kv, n]
            kept = profile_kept_counts(profile, scores, allocation)
            for layer in model.model.layers:
                module = layer.self_attn
                lid = int(module.layer_idx)
                device = next(module.parameters()).device
                module.masked_key_indices = evicted_indices(profile, scores[lid], kept[lid], device)

    return ProfileBudgetKVzipPress(compression_ratio=compression_ratio)


def _kept_counts(num_heads: int, num_stored: int, masked: tuple | None) -> list[int]:
    """Entries each KV head of a layer kept: stored minus AdaKV's masked ones (tokens).

    ``masked`` is kvpress's ``masked_key_indices`` (batch, head, position index tensors) or None.
    """
    if masked is None:
        return [num_stored] * num_heads
    import torch

    dropped = torch.bincount(masked[1].flatten(), minlength=num_heads)
    return [num_stored - int(d) for d in dropped]
