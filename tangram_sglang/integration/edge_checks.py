"""HTTP-side request checks of a ``--tangram`` server: refuse what would crash the scheduler.

SGLang 0.5.17 validates lengths in ``TokenizerManager._validate_one_request`` but lets through
inputs that then crash its scheduler process (the whole server exits), so one bad request would
take a Tangram server down:

* ``/generate`` ``input_ids`` outside ``[0, vocab_size)`` (``-1``, ``vocab_size``, ``10**9``):
  the embedding lookup raises in the scheduler;
* an empty prompt sent as ids in the batch form (``{"input_ids": [[]]}``, OpenAI ``"prompt":
  [[]]``): the scheduler runs a 0-token extend and its rotary embedding raises;
* ``stop_token_ids`` outside ``[0, vocab_size)``: the ``min_new_tokens`` penalizer scatters them
  into a ``[bs, vocab_size + 1]`` tensor (out of bounds on CPU, a device-side assert on CUDA);
* ``top_logprobs_num`` (OpenAI ``top_logprobs``) above ``vocab_size``: ``torch.topk`` raises
  "selected index k out of range" in ``logprob_processor.py``;
* logprobs, hidden states or input embeddings on a server whose scorer replays each
  compressed segment (``--tangram-scorer kvzip``): the replay tokens share the extend forward
  and would shift SGLang's per-token arithmetic for them;
* a grammar-constrained request (``regex``, ``json_schema``, ``ebnf``, ``structural_tag``;
  OpenAI ``response_format``) with the ``xgrammar`` backend on a CPU server: its token bitmask
  is allocated in pinned memory and applied with a GPU kernel, both of which raise on CPU.

:func:`check_request` runs after SGLang's own validation, in the HTTP server process, and raises
``ValueError``, which SGLang answers as HTTP 400 (``/generate``: ``{"error": {...}}``;
``/v1/*``: the OpenAI error object). It does nothing on servers without ``--tangram``.
"""

from __future__ import annotations

import functools
from typing import Any

GRAMMAR_FIELDS = ("regex", "json_schema", "ebnf", "structural_tag")


def check_request(manager: Any, obj: Any, input_ids: Any = None, *args: Any, **kw: Any) -> None:
    """AFTER ``TokenizerManager._validate_one_request``: refuse inputs the scheduler crashes on.

    Args:
        manager: SGLang's ``TokenizerManager`` (``server_args``, ``model_config``).
        obj: one ``GenerateReqInput`` (or ``EmbeddingReqInput``: left alone).
        input_ids: the request's token ids (list of int), tokenized or as sent.

    Raises:
        ValueError: naming the field, the bad value, the valid range and the fix (HTTP 400).
    """
    server_args = manager.server_args
    if not getattr(server_args, "tangram", False) or not hasattr(obj, "top_logprobs_num"):
        return
    vocab = int(manager.model_config.vocab_size)
    if input_ids is not None and len(input_ids) == 0:
        raise ValueError(
            "the prompt is empty (input_ids has no token): send at least one token id, or text"
        )
    if getattr(obj, "input_ids", None) is not None and input_ids:
        check_token_ids(input_ids, vocab)
    stop_ids = (obj.sampling_params or {}).get("stop_token_ids")
    if stop_ids:
        check_token_ids(list(stop_ids), vocab, field="stop_token_ids")
    top = obj.top_logprobs_num
    if obj.return_logprob and isinstance(top, int) and not 0 <= top <= vocab:
        raise ValueError(
            f"top_logprobs {top} (top_logprobs_num) is outside [0, {vocab}], the vocabulary "
            f"size of the served model; ask for at most {vocab}"
        )
    check_grammar(obj.sampling_params or {}, server_args)
    asked = [
        name
        for name, on in (
            ("logprobs (return_logprob; OpenAI logprobs / top_logprobs)", obj.return_logprob),
            (
                "every token's hidden states (return_hidden_states: true)",
                getattr(obj, "return_hidden_states", False) is True,
            ),
            ("input embeddings (input_embeds)", getattr(obj, "input_embeds", None) is not None),
        )
        if on
    ]
    if asked and serves_replay(server_args):
        raise ValueError(
            f"{asked[0]} are not available on a server whose scorer replays each compressed "
            "segment (--tangram-scorer kvzip): the replay tokens share the forward with the "
            "prompt; send the request without them, or serve with another scorer (kvzip-lite)"
        )


def serves_replay(server_args: Any) -> bool:
    """Whether the server's profile scorer runs the replay pass (``scoring.kvzip``)."""
    from tangram_sglang.integration.server_args import PROFILE_STASH, profile_from_server_args

    stash = getattr(server_args, PROFILE_STASH, None)
    if stash is not None:  # the HTTP process: the profile JSON stashed at start-up
        return _scorer_replays(stash)
    from tangram_sglang.scoring.kvzip import needs_replay

    return needs_replay(profile_from_server_args(server_args).scorer)


@functools.lru_cache(maxsize=4)
def _scorer_replays(profile_json: str) -> bool:
    """Whether the profile (its JSON text) names a replay scorer; parsed once per profile."""
    from tangram_sglang.integration.profile_loader import profile_from_json
    from tangram_sglang.scoring.kvzip import needs_replay

    return needs_replay(profile_from_json(profile_json).scorer)


def check_token_ids(input_ids: list[Any], vocab_size: int, field: str = "input_ids") -> None:
    """Every id an integer in ``[0, vocab_size)``.

    Args:
        input_ids: the ids to check.
        vocab_size: the served model's vocabulary size.
        field: the request field the ids came from (named in the error).

    Raises:
        ValueError: the first bad id and its position.
    """
    for pos, tid in enumerate(input_ids):
        if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < vocab_size:
            raise ValueError(
                f"{field}[{pos}] = {tid!r} is not a token id of the served model: ids must be "
                f"integers in [0, {vocab_size}) (its vocabulary size); send `text` or ids from "
                "the model's tokenizer"
            )


def check_grammar(sampling_params: dict[str, Any], server_args: Any) -> None:
    """Refuse grammar-constrained decoding that the server's grammar backend cannot run.

    Raises:
        ValueError: a constrained request with ``xgrammar`` on a CPU server.
    """
    asked = [name for name in GRAMMAR_FIELDS if sampling_params.get(name) is not None]
    if not asked or str(server_args.device) != "cpu":
        return
    if server_args.grammar_backend in (None, "xgrammar"):
        raise ValueError(
            f"constrained decoding ({', '.join(asked)}; OpenAI response_format) needs a GPU "
            "with the xgrammar grammar backend (this server runs on CPU: xgrammar pins its "
            "token mask and applies it with a GPU kernel); send the request without it, or to "
            "a GPU server"
        )
