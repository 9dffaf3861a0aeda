"""The multi-turn load generator of ``bench.multiturn``: clients, rounds, barrier, rate, cap.

Every client runs its conversation round by round; round r+1 of a client is sent when its
round r answered (and, with ``round_barrier``, when every client finished round r). New
requests start at most ``request_rate`` per second (Poisson arrivals; ``inf`` = no pacing) and
at most ``max_parallel`` are in flight. Each request is a streaming ``POST /generate`` with
``input_ids`` = the whole history + the round's new random ids, ``ignore_eos`` and greedy
sampling, so every round generates exactly its output length. With ``no_max_tokens`` a request
leaves ``max_new_tokens`` unset (what most chat clients send; the server fills in its own cap).
On ``/generate`` that takes an explicit ``"max_new_tokens": null``: a key left out gets
SGLang's ``SamplingParams`` default of 128 tokens, which caps every output at 128 and rejects a
``min_new_tokens`` above it (HTTP 400). Then each request draws a length ``n`` (geometric, mean L
for a round of output length L) from a generator seeded by (seed, client, round) and samples at
temperature 1 with ``min_new_tokens`` = ``n - 1``, one fixed stop id (:func:`stop_token_ids` of
size 1) and a ``logit_bias`` of ``STOP_BIAS`` on that id: SGLang's min-new-tokens penalizer holds
the id at ``-inf`` for the first ``n - 1`` tokens, after which the bias makes it the next token,
and the model config's EOS ids (which the server stops on, but the penalizer does not hold off)
get ``-STOP_BIAS``, so the request ends at exactly ``n`` tokens whatever the weights. So every
system generates the same output lengths (equal work, as ``ignore_eos`` gives with
``max_new_tokens`` set), while the lengths still differ between conversations and the
conversations fall out of step as a chat client's do. Per request it records TTFT, TPOT,
end-to-end latency and the server's usage (``prompt_tokens``, ``cached_tokens``:
SGLang's ``--enable-cache-report``).

Source: SGLang ``benchmark/hicache/bench_multiturn.py`` (same knobs, token ids instead of text).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np

from tangram_sglang.bench.multiturn_workloads import ID_LOW, Conversation


@dataclass(frozen=True, slots=True)
class LoadSettings:
    """Client-side knobs (SGLang bench_multiturn's names)."""

    max_parallel: int = 128  # requests in flight at most
    request_rate: float = float("inf")  # new requests per second (Poisson); inf = no pacing
    round_barrier: bool = False  # every client finishes round r before any starts r + 1
    timeout_s: float = 600.0  # wall-clock cap of the whole workload (s)
    seed: int = 0
    no_max_tokens: bool = False  # no max_new_tokens: geometric lengths (mean L), a stop id
    eos_ids: tuple[int, ...] = ()  # the model's EOS ids, held off in no-max requests
    warmup_clients: int = 0  # unmeasured warm-up conversations before each workload


STOP_SEED = 1234  # the stop-id subsets are the same for every system and run


def stop_token_ids(vocab_size: int, mean_length: int, seed: int = STOP_SEED) -> list[int]:
    """A fixed random subset of ``max(1, round(vocab_size / mean_length))`` token ids.

    Sampling uniformly from the vocabulary, each step hits the subset with probability
    ``1 / mean_length``: the output length is geometric with mean ``mean_length`` (tokens).
    The same (vocab, mean) always gives the same ids.
    """
    size = min(max(1, round(vocab_size / max(int(mean_length), 1))), vocab_size)
    rng = np.random.default_rng(seed + int(mean_length))
    return sorted(int(i) for i in rng.choice(vocab_size, size=size, replace=False))


@dataclass(slots=True)
class RequestRecord:
    """One answered (or failed) request."""

    client: int
    round: int
    prompt_tokens: int  # the server's count
    cached_tokens: int  # prompt tokens the server took from its prefix cache
    output_tokens: int
    ttft_s: float | None
    tpot_s: float | None  # mean time per output token after the first (s)
    latency_s: float
    end_s: float  # finish time since the workload's start (s)
    error: str | None = None


# A run's server peaks (``multiturn.GAUGES``, polled from ``/metrics``) under their result keys.
PEAK_KEYS = {
    "peak_running_reqs": "sglang:num_running_reqs",
    "peak_token_usage": "sglang:token_usage",
    "peak_used_tokens": "sglang:num_used_tokens",
    "peak_tangram_pages_used": "tangram:pages_used",
    "peak_tangram_kv_bytes_held": "tangram:kv_bytes_held",
    "retracted_requests_total": "sglang:num_retracted_requests_total",
}


def token_figures(
    output_tokens: int, prompt_tokens: int, cached_tokens: int, wall_s: float, answered: int
) -> dict:
    """A run's token counts and rates, as both clients report them: ``output_tok_per_s``,
    ``mean_output_tokens`` (per answered request; None when none), ``total_tok_per_s``
    (prompt + output per second) and ``cache_hit_rate`` (cached / prompt tokens)."""
    return {
        "output_tokens": output_tokens,
        "prompt_tokens": prompt_tokens,
        "output_tok_per_s": output_tokens / wall_s if wall_s else 0.0,
        "mean_output_tokens": output_tokens / answered if answered else None,
        "total_tok_per_s": (output_tokens + prompt_tokens) / wall_s if wall_s else 0.0,
        "cache_hit_rate": cached_tokens / prompt_tokens if prompt_tokens else 0.0,
    }


def shared_prefix_ids(rng, conversations: list[Conversation], vocab_size: int) -> list[int]:
    """The ids of the longest ``shared_prefix`` among ``conversations``, drawn first from
    ``rng`` (a numpy Generator), so every conversation's round 1 starts with the same ids."""
    shared = max((c.shared_prefix for c in conversations), default=0)
    return rng.integers(ID_LOW, vocab_size - ID_LOW, shared).tolist()


def round_ids(
    rng, conv: Conversation, r: int, new_tokens: int, shared_ids: list[int], vocab_size: int
) -> list[int]:
    """Round ``r``'s ``new_tokens`` random ids in ``[ID_LOW, vocab_size - ID_LOW)``; round 0
    begins with the conversation's ``shared_prefix`` ids of ``shared_ids``."""
    ids = rng.integers(ID_LOW, vocab_size - ID_LOW, new_tokens).tolist()
    if r == 0 and conv.shared_prefix:
        ids[: conv.shared_prefix] = shared_ids[: conv.shared_prefix]
    return ids


class _Pacer:
    """Poisson start times shared by all clients (request_rate per second)."""

    def __init__(self, rate: float, seed: int) -> None:
        self.rate, self.rng, self.next_t = rate, np.random.default_rng(seed), time.perf_counter()
        self.lock = asyncio.Lock()

    async def wait(self) -> None:
        if not np.isfinite(self.rate):
            return
        async with self.lock:
            self.next_t = max(self.next_t, time.perf_counter()) + self.rng.exponential(
                1.0 / self.rate
            )
            delay = self.next_t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)


# no max_new_tokens: the logit bias of the one stop id, which ends a request right after its
# min_new_tokens (exp(-100) against any other token's logit: never another token after that)
STOP_BIAS = 100.0
KEEPALIVE_S = 2.0  # below uvicorn's default keep-alive limit (5 s), see run_conversations


def no_max_length(out_len: int, seed: int, client: int, round_index: int) -> int:
    """Output length (tokens, >= 1) of one request without ``max_new_tokens``.

    Geometric with mean ``out_len``, from a generator seeded by ``(seed, client, round_index)``:
    the same for every system and run, whatever order the clients' requests go out in.
    """
    rng = np.random.default_rng((seed, client, round_index))
    return int(rng.geometric(1.0 / max(int(out_len), 1)))


def model_eos_ids(model_dir: str | Path) -> tuple[int, ...]:
    """The EOS ids a server stops on for this model: ``eos_token_id`` (an int or a list) of its
    ``config.json`` and ``generation_config.json``, sorted; files or keys missing are skipped."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        try:
            value = json.loads((Path(model_dir) / name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        values = value if isinstance(value, list) else [value]
        ids.update(v for v in values if isinstance(v, int) and not isinstance(v, bool))
    return tuple(sorted(ids))


def sampling_params(
    out_len: int,
    vocab_size: int,
    no_max_tokens: bool,
    length: int | None = None,
    eos_ids: tuple[int, ...] | list[int] = (),
) -> dict:
    """The ``sampling_params`` of one request (see the module docstring).

    Args:
        out_len: the round's output length (tokens): exact with ``max_new_tokens`` set, the
            mean otherwise.
        vocab_size: the model's vocabulary size (stop ids are drawn below it).
        no_max_tokens: leave ``max_new_tokens`` unset (``None``, sent as JSON ``null``).
        length: without ``max_new_tokens``, this request's drawn length (:func:`no_max_length`);
            None = ``out_len``.
        eos_ids: the model's EOS ids (:func:`model_eos_ids`). Without ``max_new_tokens`` each
            gets a logit bias of ``-STOP_BIAS``: SGLang's min-new-tokens penalizer holds off the
            tokenizer's EOS and the stop ids only, while the server also stops on the model
            config's EOS ids (SmolLM2: tokenizer EOS 1, config EOS 2), which would end a request
            before its drawn length.
    """
    if no_max_tokens:
        (stop,) = stop_token_ids(vocab_size, vocab_size)
        bias = {str(int(e)): -STOP_BIAS for e in eos_ids if int(e) != stop}
        bias[str(stop)] = STOP_BIAS
        return {
            "max_new_tokens": None,  # unset; an absent key would be SGLang's default, 128
            "temperature": 1.0,
            "min_new_tokens": max((out_len if length is None else length) - 1, 0),
            "stop_token_ids": [stop],
            "logit_bias": bias,
        }
    return {"max_new_tokens": out_len, "ignore_eos": True, "temperature": 0.0}


async def _generate(session, url: str, ids: list[int], params: dict) -> tuple[dict, list[int]]:
    """Stream one ``/generate``; returns (timing + usage dict, output ids)."""
    payload = {"input_ids": ids, "stream": True, "sampling_params": params}
    t0 = time.perf_counter()
    ttft, last, meta, out_ids = None, t0, {}, []
    async with session.post(url, json=payload) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(str(chunk["error"])[:300])
            last = time.perf_counter()
            ttft = last - t0 if ttft is None else ttft
            meta = chunk.get("meta_info", meta)
            new = chunk.get("output_ids") or []
            done = int(meta.get("completion_tokens", 0))
            out_ids = list(new) if len(new) == done else out_ids + list(new)  # cumulative or delta
    n = int(meta.get("completion_tokens", len(out_ids)))
    tpot = (last - t0 - ttft) / (n - 1) if ttft is not None and n > 1 else None
    timing = {
        "ttft_s": ttft,
        "tpot_s": tpot,
        "latency_s": time.perf_counter() - t0,
        "prompt_tokens": int(meta.get("prompt_tokens", len(ids))),
        "cached_tokens": int(meta.get("cached_tokens", 0) or 0),
        "output_tokens": n,
    }
    return timing, out_ids


async def run_conversations(
    base_url: str, conversations: list[Conversation], vocab_size: int, settings: LoadSettings
) -> tuple[list[RequestRecord], float]:
    """Run every conversation to its end (or ``settings.timeout_s``).

    Returns:
        (records of the requests that ended, wall time in seconds).
    """
    rng = np.random.default_rng(settings.seed)
    shared_ids = shared_prefix_ids(rng, conversations, vocab_size)
    sem, pacer = (
        asyncio.Semaphore(settings.max_parallel),
        _Pacer(settings.request_rate, settings.seed),
    )
    num_rounds = max(len(c.rounds) for c in conversations)
    barriers = [asyncio.Event() for _ in range(num_rounds)]
    left = [sum(len(c.rounds) > r for c in conversations) for r in range(num_rounds)]
    records: list[RequestRecord] = []
    t_start = time.perf_counter()

    async def client(i: int, conv: Conversation, session) -> None:
        history: list[int] = []
        for r, (new_tokens, out_len) in enumerate(conv.rounds):
            if settings.round_barrier and r > 0:
                await barriers[r - 1].wait()
            new = round_ids(rng, conv, r, new_tokens, shared_ids, vocab_size)
            await pacer.wait()
            async with sem:
                try:
                    length = no_max_length(out_len, settings.seed, i, r)
                    params = sampling_params(
                        out_len, vocab_size, settings.no_max_tokens, length, settings.eos_ids
                    )
                    timing, out_ids = await _generate(
                        session, f"{base_url}/generate", history + new, params
                    )
                    records.append(
                        RequestRecord(i, r, end_s=time.perf_counter() - t_start, **timing)
                    )
                except (TimeoutError, RuntimeError, aiohttp.ClientError) as exc:
                    records.append(
                        RequestRecord(
                            i,
                            r,
                            0,
                            0,
                            0,
                            None,
                            None,
                            0.0,
                            time.perf_counter() - t_start,
                            repr(exc)[:300],
                        )
                    )
                    out_ids = []
            history += new + out_ids
            left[r] -= 1
            if left[r] == 0:
                barriers[r].set()

    timeout = aiohttp.ClientTimeout(total=None, sock_read=settings.timeout_s)
    # Idle pooled connections close on the client's side first (2 s, uvicorn closes them after
    # 5 s): a client waiting at a round barrier would otherwise reuse a connection the server
    # has just closed and see ServerDisconnectedError.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        tasks = [asyncio.create_task(client(i, c, session)) for i, c in enumerate(conversations)]
        _, pending = await asyncio.wait(tasks, timeout=settings.timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return records, time.perf_counter() - t_start
