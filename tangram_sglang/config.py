"""TangramConfig: the validated Tangram options of one server.

Built at start-up from SGLang's ``--tangram*`` flags (``integration/server_args.py`` reads them off
``ServerArgs``) or directly in tests. It holds options only: loading the budget profile, matching
it to the model, rescaling and regrouping it are done by ``integration/server_args.py``, which
sits right of ``profile`` in the module order (docs/design.md §8). This module imports nothing
but ``errors`` and the standard library, and never ``sglang``.

Every bad value raises :class:`~tangram_sglang.errors.ConfigError` naming the command-line flag,
the allowed values and the fix.
"""

from __future__ import annotations

import math
import os
import reprlib
from dataclasses import dataclass
from pathlib import Path

from tangram_sglang.errors import ConfigError

# Must equal grouping.SCOPES (tests/unit/test_config.py checks it); repeated here because config
# sits left of grouping in the module order.
SCOPES = ("per_layer", "global")
DEFAULT_PAGE_SIZE = 16  # tokens per page: a power of two, as the Triton kernels' PAGE_SIZE needs
MAX_PAGE_SIZE = 1024  # tokens; a page is page_size x H_p x head_dim elements for K and for V
MAX_PAGE_GROUP_SIZE = 256  # KV heads per head group (H_p); no model has more KV heads per layer
# Segments shorter than this many tokens are kept whole and not scored. Below it the always-kept
# sink + recent window dominate (a 128-token segment keeps ~0.65 of its tokens at ratio 0.25 with
# a 64-token window; a 64-token one keeps all of it), so scoring saves little memory for a
# scoring pass per layer, and a short segment is usually the question the model must answer.
# Measured with `python -m tangram_sglang.bench.kv_held` (Llama-3.1-8B geometry, 0.25 profile,
# page 16): ShareGPT 64x4 scores 18 of 256 segments instead of 38 for +1.0 point of memory
# (0.941 vs 0.930 of full KV); 512 would also stop compressing the cliff workload's 256-token
# rounds (0.443 vs 0.423 of full KV: -4.4% capacity where memory is the limit).
DEFAULT_MIN_COMPRESS_TOKENS = 256  # tokens


@dataclass(frozen=True, slots=True)
class TangramConfig:
    """Tangram options, validated on construction.

    Attributes:
        enabled: ``--tangram``; when False the other fields are not checked and nothing is
            compressed.
        profile_path: ``--tangram-profile``: the budget profile JSON; None means the shipped
            profile for the served model (looked up at start-up by ``integration/``).
        page_group_size: ``--tangram-page-group-size``: H_p, KV heads sharing one page table;
            None keeps the profile's grouping.
        page_size: ``--tangram-page-size``: tokens per page (power of two, 1..1024).
        target_ratio: ``--tangram-target-ratio``: rescale the profile so that its mean kept
            fraction is this value (in (0, 1]); None keeps the profile's ratios.
        scope: ``--tangram-scope``: head-group scope (``per_layer`` | ``global``); None keeps the
            profile's.
        min_compress_tokens: ``--tangram-min-compress-tokens``: segments shorter than this are
            kept whole and not scored (tokens, >= 0; 0 compresses every length).
        scorer: ``--tangram-scorer``: the scorer the server compresses with (a registered
            name, ``tangram_sglang.scoring.available_scorers()``). Budgets are calibrated per
            scorer, so it picks the shipped profile calibrated with it, or must match
            ``--tangram-profile``'s; None = the profile's (default: the shipped default's).
            The name is checked against the registry at start-up
            (``integration.profile_loader.check_scorer_name``).

    Raises:
        ConfigError: any field out of range; the message names the flag and the fix.

    Source: docs/design.md §2 (head group, page); Tangram arXiv 2606.06302 (Ragged Paging).
    """

    enabled: bool = False
    profile_path: str | None = None
    page_group_size: int | None = None
    page_size: int = DEFAULT_PAGE_SIZE
    target_ratio: float | None = None
    scope: str | None = None
    min_compress_tokens: int = DEFAULT_MIN_COMPRESS_TOKENS
    scorer: str | None = None

    def __post_init__(self) -> None:
        if self.enabled:
            self.validate()

    def validate(self) -> None:
        """Check every field; raises :class:`ConfigError` naming the flag and the fix."""
        _check_profile_path(self.profile_path)
        _check_page_size(self.page_size)
        _check_page_group_size(self.page_group_size)
        _check_target_ratio(self.target_ratio)
        _check_min_compress_tokens(self.min_compress_tokens)
        if self.scope is not None and self.scope not in SCOPES:
            raise ConfigError(
                f"--tangram-scope {self.scope!r} is unknown; use one of {list(SCOPES)} "
                "(or leave it out to keep the profile's scope)"
            )

    def as_dict(self) -> dict[str, object]:
        """The options as plain builtins (for logs and ``/server_info``)."""
        return {
            "enabled": self.enabled,
            "profile_path": self.profile_path,
            "page_group_size": self.page_group_size,
            "page_size": self.page_size,
            "target_ratio": self.target_ratio,
            "scope": self.scope,
            "min_compress_tokens": self.min_compress_tokens,
            "scorer": self.scorer,
        }


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_profile_path(path: str | None) -> None:
    if path is None:  # the shipped default for the served model is looked up at start-up
        return
    if not isinstance(path, str | Path) or not Path(path).is_file():
        raise ConfigError(
            f"--tangram-profile {path!r}: no such file; pass an existing profile JSON, leave "
            "the flag out to use the shipped profile for the model, or calibrate one with "
            "`python -m tangram_sglang.calibrate --model-path ...`"
        )


def _check_page_size(page_size: object) -> None:
    ok = _is_int(page_size) and 1 <= page_size <= MAX_PAGE_SIZE
    if not ok or page_size & (page_size - 1):
        raise ConfigError(
            f"--tangram-page-size {page_size!r} must be a power of two in [1, {MAX_PAGE_SIZE}] "
            f"tokens (default {DEFAULT_PAGE_SIZE})"
        )


def _check_page_group_size(size: object) -> None:
    if size is None:
        return
    if not _is_int(size) or not 1 <= size <= MAX_PAGE_GROUP_SIZE:
        raise ConfigError(
            f"--tangram-page-group-size {size!r} must be an integer in [1, "
            f"{MAX_PAGE_GROUP_SIZE}] KV heads (or leave it out to keep the profile's grouping)"
        )


def _check_target_ratio(ratio: object) -> None:
    if ratio is None:
        return
    ok = isinstance(ratio, int | float) and not isinstance(ratio, bool)
    if not ok or not math.isfinite(ratio) or not 0.0 < ratio <= 1.0:
        raise ConfigError(
            f"--tangram-target-ratio {ratio!r} must be a number in (0, 1]: the mean fraction "
            "of the KV cache to keep (or leave it out to keep the profile's ratios)"
        )


def _check_min_compress_tokens(tokens: object) -> None:
    if not _is_int(tokens) or tokens < 0:
        raise ConfigError(
            f"--tangram-min-compress-tokens {tokens!r} must be an integer >= 0: segments "
            "shorter than this many tokens are kept whole (0 compresses every segment; default "
            f"{DEFAULT_MIN_COMPRESS_TOKENS})"
        )


# Environment switch of grid segmentation (read once per server, at start-up; see segment_grid).
GRID_ENV = "TANGRAM_GRID_SEGMENTS"


def segment_grid(chunk_tokens: int, environ: dict[str, str] | None = None) -> int:
    """Tokens per segment-grid cell: ``--chunked-prefill-size`` under grid segmentation, else 0.

    With ``TANGRAM_GRID_SEGMENTS=1`` prompt segments are cut at absolute multiples of the chunk
    size ``C``: every prefill chunk starts at a multiple of ``C`` and is one segment, and the
    radix tree matches only at those cuts. A segment then depends on its own tokens and the
    tokens before it only, never on what the tree held when the request came, so a conversation
    gets the same kept KV on a server that cached its earlier turns and on one that did not
    (docs/design.md §5.1). The grid must equal the chunk size: the new tokens of one chunk attend
    to each other uncompressed, so a cut inside a chunk would not be where a cold server cuts.

    Args:
        chunk_tokens: SGLang's ``--chunked-prefill-size`` (tokens; <= 0 = chunking off).
        environ: the environment to read (default ``os.environ``).

    Returns:
        ``C`` (tokens) when the switch is on, 0 when it is off or unset.

    Raises:
        ConfigError: a value other than 0/1, or the switch on with chunked prefill off.
    """
    raw = (os.environ if environ is None else environ).get(GRID_ENV, "0").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return 0
    if raw not in ("1", "true", "yes", "on"):
        raise ConfigError(
            f"{GRID_ENV}={raw!r}: use 1 to cut prompt segments at multiples of "
            "--chunked-prefill-size (hot and cold servers keep the same tokens) or 0 to cut them "
            "where the radix match ends (default)"
        )
    if int(chunk_tokens) <= 0:
        raise ConfigError(
            f"{GRID_ENV}=1 cuts prompt segments at multiples of --chunked-prefill-size, but "
            f"chunked prefill is off ({int(chunk_tokens)}); pass --chunked-prefill-size N (the "
            f"grid, tokens) or unset {GRID_ENV}"
        )
    return int(chunk_tokens)


# Environment switch of the extend attention's new-token part (read once per server, at start-up).
PREFILL_ATTENTION_ENV = "TANGRAM_PREFILL_ATTENTION"
PREFILL_ATTENTIONS = ("auto", "flashinfer", "triton")


def prefill_attention(environ: dict[str, str] | None = None) -> str:
    """Who computes an extend's attention: ``"auto"`` (default), ``"triton"`` or ``"flashinfer"``.

    ``triton``: Tangram's extend kernel, history and new tokens in one pass. ``flashinfer``: the
    new tokens' causal attention through FlashInfer's ragged prefill (stock SGLang's flashinfer
    kernels), the history through Tangram's kernel (or FlashInfer's paged prefill, see
    :func:`history_attention`) only when a request of the batch has history, merged by LSE
    (``kernels.new_token_attention``); refuses a model FlashInfer cannot run (float32).
    ``auto``: per batch, the FlashInfer split where it pays (``metadata.split_pays``: a batch
    without history, or long new segments, or a paged-history plan), Tangram's kernel otherwise,
    and Tangram's kernel everywhere when FlashInfer cannot run the model's dtype, the flashinfer
    package is missing or its 384 MiB workspace does not fit (logged). The default:
    on the H200 it ran 2.9% above ``triton`` on ShareGPT 64 x 4 at kept 0.25, side by side
    (``benchmarks/RESULTS.md``, 2026-12-04). CUDA only: CPU servers keep the torch reference
    whatever the value.

    Args:
        environ: the environment to read (default ``os.environ``); unset or empty = ``auto``.

    Returns:
        One of :data:`PREFILL_ATTENTIONS`.

    Raises:
        ConfigError: any other value.
    """
    raw = (os.environ if environ is None else environ).get(PREFILL_ATTENTION_ENV, "")
    value = raw.strip().lower()
    if value == "":
        return "auto"
    if value not in PREFILL_ATTENTIONS:
        raise ConfigError(
            f"{PREFILL_ATTENTION_ENV}={raw!r}: use 'auto' (FlashInfer for the new tokens where it "
            "pays, default), 'triton' (Tangram's extend kernel only) or 'flashinfer' (always)"
        )
    return value


# Environment switch of the extend attention's history part (read once per server, at start-up).
HISTORY_ATTENTION_ENV = "TANGRAM_HISTORY_ATTENTION"
HISTORY_ATTENTIONS = ("auto", "flashinfer", "triton")


def history_attention(environ: dict[str, str] | None = None) -> str:
    """Who computes the history part of an extend: ``"auto"`` (default), ``"flashinfer"`` or
    ``"triton"``.

    ``triton``: Tangram's extend kernel (with the new tokens, or alone in a split extend).
    ``flashinfer``: FlashInfer's paged prefill over each (request, KV head)'s single-head pages
    (``kernels.history_attention``), in batches whose history lengths are the same on every
    layer (ratio 1.0, histories kept whole) and long enough to pay for its plan; such a batch
    is split (new tokens through FlashInfer's ragged prefill). Other batches keep Tangram's
    kernel; so does every batch of a float32 model or of a server without the flashinfer package
    (logged at start-up). On CPU,
    ``flashinfer`` runs the same plans through FlashInfer's semantics in torch
    (``kernels.history_attention.TorchPagedHistory``), with no work floor: a check of the plans
    end to end, not a speed-up. ``auto``: ``flashinfer`` on CUDA servers whose new tokens go
    through FlashInfer (``TANGRAM_PREFILL_ATTENTION`` not ``triton``), a missing package, a
    float32 model or no room for it logged at info level rather than as a warning; ``triton``
    on CPU. The default: side by side with stock on an H100 it ran cliff-64 at ratio 1.0 at
    0.964x stock flashinfer and ShareGPT 64 x 4 at 0.983x (1.0) and 1.008x (0.25) stock triton,
    all above the 0.95 bar, where Tangram's kernel had given the cliff 0.949x on the H200 (no
    same-machine A/B of the two history kernels yet; ``benchmarks/RESULTS.md``, 2026-12-05).

    Args:
        environ: the environment to read (default ``os.environ``); unset or empty = ``auto``.

    Returns:
        One of :data:`HISTORY_ATTENTIONS`.

    Raises:
        ConfigError: any other value, or ``flashinfer`` together with
            ``TANGRAM_PREFILL_ATTENTION=triton`` (which keeps every batch in Tangram's kernel).
    """
    env = os.environ if environ is None else environ
    raw = env.get(HISTORY_ATTENTION_ENV, "")
    value = raw.strip().lower()
    if value == "":
        return "auto"
    if value not in HISTORY_ATTENTIONS:
        raise ConfigError(
            f"{HISTORY_ATTENTION_ENV}={raw!r}: use 'auto' (FlashInfer's paged prefill where "
            "every layer has the same history lengths, on CUDA; default), 'flashinfer' (the "
            "same, and on CPU its torch semantics) or 'triton' (Tangram's history kernel)"
        )
    if value == "flashinfer" and prefill_attention(env) == "triton":
        raise ConfigError(
            f"{HISTORY_ATTENTION_ENV}=flashinfer needs the split extend, which "
            f"{PREFILL_ATTENTION_ENV}=triton turns off; unset {PREFILL_ATTENTION_ENV} (auto) or "
            f"unset {HISTORY_ATTENTION_ENV}"
        )
    return value


# CTAs per SM one decode launch aims for (read once per server, at start-up): sets the split
# table's CTA budget per row and the batch plan's chunk floor (kernels/split_table.py).
DECODE_CTAS_ENV = "TANGRAM_DECODE_CTAS_PER_SM"
DEFAULT_DECODE_CTAS_PER_SM = 12  # split_table.CTAS_PER_SM (the measurements are there)
MAX_DECODE_CTAS_PER_SM = 64
_SHORT_REPR = reprlib.Repr()  # a long bad value, cut short in its error message
_SHORT_REPR.maxstring = 40  # (keyword arguments to Repr() need Python 3.12)


def decode_ctas_per_sm(environ: dict[str, str] | None = None) -> int:
    """CTAs per SM a decode launch aims for: ``TANGRAM_DECODE_CTAS_PER_SM``, default
    :data:`DEFAULT_DECODE_CTAS_PER_SM` (12, ``split_table.CTAS_PER_SM``).

    Every decode plan reads it (``batch``'s floor, every plan's CTA budget per row). Under the
    ``batch`` plan, 12 was within 1.1% of the fastest value tried (3, 8, 12, 28) in each of six
    decode shapes on an H100, and 13-14% faster than 8 on 8 and 23 rows of 16k tokens
    (``benchmarks/RESULTS.md``, issue 18); another GPU or head size may prefer another value,
    which ``bench.kernels`` under this variable measures.

    Args:
        environ: the environment to read (default ``os.environ``); unset or empty means the
            default.

    Returns:
        A whole number in ``[1, MAX_DECODE_CTAS_PER_SM]``.

    Raises:
        ConfigError: anything else, naming the variable.
    """
    raw = (os.environ if environ is None else environ).get(DECODE_CTAS_ENV, "").strip()
    if raw == "":
        return DEFAULT_DECODE_CTAS_PER_SM
    ok = raw.isascii() and raw.isdigit() and len(raw) <= 3
    if not ok or not 1 <= int(raw) <= MAX_DECODE_CTAS_PER_SM:
        raise ConfigError(
            f"{DECODE_CTAS_ENV}={_SHORT_REPR.repr(raw)}: use a whole number of CTAs per SM in "
            f"[1, {MAX_DECODE_CTAS_PER_SM}], or unset it for the default "
            f"({DEFAULT_DECODE_CTAS_PER_SM})"
        )
    return int(raw)


# Environment switch of the decode kernel's split plan (read once per server, at start-up).
DECODE_PLAN_ENV = "TANGRAM_DECODE_PLAN"
DECODE_PLANS = ("batch", "lengths", "table")


def decode_plan(environ: dict[str, str] | None = None) -> str:
    """The decode kernel's split plan: ``"batch"`` (default), ``"lengths"`` or ``"table"``.

    ``batch`` fits each KV head's split-KV partition to the row's real kept lengths inside the
    kernel every step, with a chunk floor from the whole batch's lengths (computed on the host,
    ``split_table.batch_chunk_floor``), so a long row among short ones splits as finely as the
    batch; ``lengths`` fits it to the row alone; ``table`` uses the static AOT split table
    (splits proportional to the group ratios), the default before ``batch``. On an H200
    (``bench.kernels``, 16 decode shapes side by side) ``batch`` was at most 1.4% slower than
    the table and 3-34% faster at 64-128 rows (15-34% at ratio 1.0).
    ``kernels/split_table.py``, docs/design.md §3.3.

    Args:
        environ: the environment to read (default ``os.environ``); ``TANGRAM_DECODE_PLAN`` unset
            or empty means ``batch``.

    Returns:
        One of :data:`DECODE_PLANS`.

    Raises:
        ConfigError: any other value.
    """
    raw = (os.environ if environ is None else environ).get(DECODE_PLAN_ENV, "").strip().lower()
    if raw == "":
        return "batch"
    if raw not in DECODE_PLANS:
        raise ConfigError(
            f"{DECODE_PLAN_ENV}={raw!r}: use 'batch' (the split fitted to each row's kept "
            "lengths with a chunk floor from the whole batch, default), 'lengths' (fitted to "
            "the row alone) or 'table' (the static AOT split table)"
        )
    return raw
