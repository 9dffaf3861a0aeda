"""KVzip: query-agnostic scores from a replay of the segment, run inside the server's extend.

KVzip (Kim et al. 2025, arXiv 2505.23416) scores a context by reconstruction: after the context
the model reads a repeat prompt ("Repeat the previous context exactly.") and the context again,
and each KV pair of the context scores the largest attention any of those replay queries, and
any query head of its GQA group, pays it. A token needed anywhere to reproduce the context
scores high, whatever question comes later, which is what later turns of a conversation need.

In the server the replay rides in the same extend forward as the segment it scores
(``integration.replay``): the scheduler adds each scored segment's replay tokens (prompt, then
the segment's ids again) to the batch, the model runs them with the segment, and the attention
backend (``backend.layer_ops.extend_layer``) hands this scorer, per layer and replayed row, the
replay's post-RoPE queries, the segment's keys and the replay queries' log-sum-exp over
everything they attend to (history, segment, prompt and the replay before them). The replay's
K/V are never stored; only the segment's kept K/V are written.

Score of token ``j`` at KV head ``h``::

    s[h, j] = max_{u, g in group(h)} exp(q[g, u] . k[h, j] * scale - lse[g, u])

i.e. the softmax probability query ``u`` of query head ``g`` gives key ``j``. KVzip normalises
over the attention sinks, the chunk and the replay tokens (kvpress 0.5.5
``KVzipPress._compute_cross_attention``); here the normaliser is the whole attention of the
replay query, compressed history included, which is the same on a first segment (its sinks are
in the segment) and the extend kernel's LSE at no extra cost on later ones.

Cost per layer and replayed segment of ``n`` tokens with ``m`` replay tokens (``m = c + n``):
``H_q * m * n * D`` multiply-adds, in blocks of :attr:`KVzipScorer.query_block` queries (the
float32 block ``[H_q, query_block, n]`` bounds the memory); the replay forward itself costs
about what the segment's prefill costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from tangram_sglang.errors import ConfigError
from tangram_sglang.scoring.base import register_scorer
from tangram_sglang.scoring.kvzip_lite import DEFAULT_QUERY_BLOCK, check_int_options
from tangram_sglang.scoring.snapkv import reduce_gqa

# The repeat prompts of KVzip (kvpress 0.5.5 ``KVzipPress.prepare``): the first before a
# context read from its start, the second before a later part, followed by the previous part's
# last PREVIOUS_TAIL_TOKENS tokens.
FIRST_PROMPT = "\n\nRepeat the previous context exactly."
LATER_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
PREVIOUS_TAIL_TOKENS = 8
NAME = "kvzip"  # the registry name


@dataclass(frozen=True, slots=True)
class KVzipScorer:
    """KVzip's reconstruction scores (module docstring), from the server's replay pass.

    Attributes:
        obs_window: 0: the scorer protocol's field; the replay's queries are what it reads.
        gqa_reduce: ``"max"`` (KVzip) or ``"mean"`` over the query heads of a KV head.
        query_block: replay queries per matmul block (memory only, >= 1).
        replay: True: the server must run the replay pass for every segment this scorer
            compresses (``integration.replay``).
    """

    obs_window: int = 0
    gqa_reduce: str = "max"
    query_block: int = DEFAULT_QUERY_BLOCK
    name: str = NAME
    replay: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_int_options(self, ("obs_window", "query_block"))
        if self.obs_window != 0:
            raise ConfigError(
                f"kvzip: obs_window={self.obs_window!r} must be 0 (the replay's queries are "
                "scored, not a window of the segment's; leave --obs-window unset)"
            )
        if self.query_block < 1:
            raise ConfigError(f"kvzip: query_block={self.query_block} must be >= 1")
        if self.gqa_reduce not in ("max", "mean"):
            raise ConfigError(f"kvzip: gqa_reduce={self.gqa_reduce!r} must be 'max' or 'mean'")

    def score(
        self,
        q_obs: torch.Tensor,
        k_seg: torch.Tensor,
        sm_scale: float,
        lse_obs: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Largest attention probability any replay query pays each token, per KV head.

        Args:
            q_obs: ``[num_qo_heads, m, D]`` post-RoPE queries of the replay tokens (the repeat
                prompt and the segment's copy), any float dtype.
            k_seg: ``[num_kv_heads, n, D]`` post-RoPE keys of the segment.
            sm_scale: softmax scale (``1/sqrt(D)`` for standard attention).
            lse_obs: float32 ``[num_qo_heads, m]``: each replay query's log-sum-exp (natural
                log) over everything it attends to (from the extend kernel). Required.

        Returns:
            float32 ``[num_kv_heads, n]`` in [0, 1] on ``k_seg``'s device.

        Raises:
            ConfigError: no ``lse_obs``, or shapes that do not fit together.
        """
        if lse_obs is None:
            raise ConfigError(
                "kvzip: score needs the replay queries' log-sum-exp (lse_obs) from the extend "
                "kernel; the attention backend passes it"
            )
        if q_obs.dim() != 3 or k_seg.dim() != 3 or q_obs.shape[-1] != k_seg.shape[-1]:
            raise ConfigError(
                f"kvzip: q_obs {list(q_obs.shape)} must be [H_q, m, D] and k_seg "
                f"{list(k_seg.shape)} [H_kv, n, D] with the same D"
            )
        num_qo_heads, m, dim = q_obs.shape
        num_kv_heads, n = k_seg.shape[0], k_seg.shape[1]
        if num_qo_heads % num_kv_heads or tuple(lse_obs.shape) != (num_qo_heads, m):
            raise ConfigError(
                f"kvzip: {num_qo_heads} query heads must be a multiple of {num_kv_heads} KV "
                f"heads and lse_obs {list(lse_obs.shape)} must be [{num_qo_heads}, {m}]"
            )
        group = num_qo_heads // num_kv_heads
        keys_t = k_seg.float().transpose(-1, -2)  # [H_kv, D, n]
        best = torch.zeros(num_qo_heads, n, device=k_seg.device)
        for first in range(0, m, self.query_block):
            last = min(first + self.query_block, m)
            q = q_obs[:, first:last].float() * sm_scale  # [H_q, b, D]
            q = q.reshape(num_kv_heads, group * (last - first), dim)  # GQA folded in
            logits = torch.matmul(q, keys_t).view(num_qo_heads, last - first, n)
            logits -= lse_obs[:, first:last].float().unsqueeze(-1)
            best = torch.maximum(best, logits.amax(dim=1).exp())
        return reduce_gqa(best, num_kv_heads, self.gqa_reduce)


@dataclass(frozen=True, slots=True)
class ReplayPrompts:
    """Token ids of KVzip's repeat prompts for one tokenizer.

    Attributes:
        first: ids of :data:`FIRST_PROMPT`.
        later: ids of :data:`LATER_PROMPT`.
        suffix: the chat template's assistant header after a user message (may be empty).
    """

    first: tuple[int, ...]
    later: tuple[int, ...]
    suffix: tuple[int, ...]

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> ReplayPrompts:
        """Encode the prompts with ``tokenizer`` (no special tokens), as kvpress does.

        Raises:
            ConfigError: no tokenizer (``--skip-tokenizer-init``).
        """
        if tokenizer is None:
            raise ConfigError(
                "--tangram-scorer kvzip encodes KVzip's repeat prompt with the model's "
                "tokenizer; drop --skip-tokenizer-init or pick another scorer (kvzip-lite)"
            )

        def encode(text: str) -> tuple[int, ...]:
            return tuple(int(t) for t in tokenizer.encode(text, add_special_tokens=False))

        suffix: tuple[int, ...] = ()
        if getattr(tokenizer, "chat_template", None):
            marker = "\n" + "#" * 13  # KVzipPress's split of a dummy user turn
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": "dummy context" + marker}],
                add_generation_prompt=True,
                tokenize=False,
            )
            if marker in text:  # a template that drops the marker leaves no suffix to find
                suffix = encode(text.split(marker)[-1])
        return cls(encode(FIRST_PROMPT), encode(LATER_PROMPT), suffix)

    def ids_for(self, fill_ids: list[int], prefix_len: int, segment_len: int) -> list[int]:
        """The replay tokens of the segment ``fill_ids[prefix_len : prefix_len + n]``.

        Args:
            fill_ids: the request's tokens up to the segment's end (SGLang's ``fill_ids``).
            prefix_len: tokens before the segment (cached prefix or earlier chunks).
            segment_len: the segment's tokens (n >= 1).

        Returns:
            The prompt, then the segment's ids (a list of ``c + n`` ints).
        """
        segment = list(fill_ids[prefix_len : prefix_len + segment_len])
        if prefix_len == 0:
            prompt = list(self.first)
        else:
            tail = fill_ids[max(prefix_len - PREVIOUS_TAIL_TOKENS, 0) : prefix_len]
            prompt = list(self.later) + list(tail)
        return prompt + list(self.suffix) + segment


def needs_replay(scorer: object) -> bool:
    """Whether ``scorer`` (an instance, or a registry name) scores from the server's replay
    pass (:class:`KVzipScorer`)."""
    if isinstance(scorer, str):
        return scorer == NAME
    return bool(getattr(type(scorer), "replay", False))


register_scorer(NAME, KVzipScorer)
