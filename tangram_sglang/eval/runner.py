"""Run every system on the same samples; one record per (system, ratio, sample, turn).

Order (server starts are the expensive part on CPU): stock SGLang once (full KV), one
``--tangram`` server per ratio, then one transformers model for every kvpress press and ratio
(one shared context prefill per sample). After every sample the partial report is written to the
JSON path, so a run cut short still leaves its finished samples on disk.

Protocols (``tasks.PROTOCOLS``, ``RunConfig.protocol``). Query-agnostic (default): on a server,
each sample's context is sent alone first (``max_new_tokens`` 1: it is prefilled, compressed under
``--tangram``, and kept in the radix tree), then each turn's full prompt; a turn whose
``cached_tokens`` is below the context's length (the context was recomputed together with the
question) stops the run with an error. On the kvpress side the press compresses the context
prefill only (``KvpressRunner.generate``). Query-aware (SnapKV): the compressed part is the whole
first prompt (``tasks.for_protocol``): on a server turn 0 is the first request (one segment),
later turns must reuse it from the radix tree (same check); kvpress compresses that prefill.

Devices (``RunConfig.device``): ``cpu`` (float32, SGLang's CPU engine) or ``cuda`` (bfloat16 for
the servers and the transformers model alike, ``systems.DEVICE_DTYPES``; the stock server uses
the triton attention backend, FA3 is not installed there). The servers and the transformers
model never run at the same time in one process (server phases first, then the kvpress phase).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tangram_sglang.config import GRID_ENV
from tangram_sglang.errors import ConfigError, TangramError
from tangram_sglang.eval import report
from tangram_sglang.eval.scoring import score
from tangram_sglang.eval.systems import (
    DEVICE_DTYPES,
    DIAGNOSTIC_PRESS_SYSTEMS,
    GRID_CELL_TOKENS,
    GRID_SYSTEMS,
    PRESS_SYSTEMS,
    PROFILE_BUDGET_SYSTEMS,
    TANGRAM_SYSTEMS,
    KvpressRunner,
    ServerClient,
    tangram_kept_fraction,
    tangram_profile,
)
from tangram_sglang.eval.tasks import (
    Conversation,
    Sample,
    build_samples,
    conversation_ids,
    for_protocol,
)
from tangram_sglang.profile import BudgetProfile, ModelIdentity
from tangram_sglang.serving import CUDA_STOCK_FLAGS

RATIO_NAME = re.compile(r"\d+(\.\d+)?")  # the ratio part of a profile's file name (0.25)
MAX_NEW_TOKENS = {"needle": 28, "squad": 24, "multiturn-squad": 24}
SYSTEMS = ("full", *TANGRAM_SYSTEMS, *PRESS_SYSTEMS, "full-hf")
# by default neither the grid systems nor the diagnostic presses (kvzip-budgets and the
# per-request allocations of eval.allocation: a second KVzip prefill or scoring forward; the
# Expected Attention presses)
DEFAULT_SYSTEMS = tuple(
    s
    for s in SYSTEMS
    if s not in GRID_SYSTEMS | PROFILE_BUDGET_SYSTEMS and s not in DIAGNOSTIC_PRESS_SYSTEMS
)
STARTUP_S = 1800.0  # server start-up limit: minutes on a busy shared CPU
CHUNKED_PREFILL_TOKENS = 16384  # > any prompt here: the whole prompt is one Tangram segment
TEMPLATE_MARGIN = 1024  # tokens the chat template, questions and multi-turn history add at most
# launch_server flags the harness adds on cuda unless --server-args has the flag (+ the stock
# server's backend, serving.CUDA_STOCK_FLAGS)
CUDA_SERVER_FLAGS = {"--sampling-backend": "pytorch"}


@dataclass(frozen=True, slots=True)
class RunConfig:
    """Everything one evaluation run needs (validated by the CLI).

    Attributes:
        model: embedded model name (``qwen2.5-0.5b``) or an HF folder.
        model_dir: the resolved HF folder.
        profile_dir: folder with ``<scorer>-r{ratio}.json`` shipped profiles (``ada-snapkv``,
            and ``kvzip-lite`` for ``tangram-kvzip-lite``).
        tasks: task names.
        ratios: average kept ratios in (0, 1].
        num_samples: samples per task.
        lengths: document lengths (tokens).
        depths: needle depths.
        num_turns: questions per multi-turn conversation.
        systems: which systems to run (subset of :data:`SYSTEMS`).
        seed: the sample seed.
        json_path: where the report goes (None: not written).
        server_args: extra ``launch_server`` flags for both servers.
        threads: torch threads of the kvpress side.
        resume: keep the records already in ``json_path`` (same samples) and run only the
            (system, ratio, sample) cells it lacks (a run killed by a time or memory limit).
        skip: leave out the first ``skip`` samples of the (interleaved) order: a second process
            that fills a run from the middle (``report.merge`` joins the JSON files).
        device: ``cpu`` or ``cuda`` (servers and the transformers model; dtype from
            ``systems.DEVICE_DTYPES``).
        protocol: ``query-agnostic`` or ``query-aware`` (``tasks.PROTOCOLS``).
        chunked_prefill_tokens: the servers' ``--chunked-prefill-size`` (tokens), above every
            prompt so that each compressed part is one segment.
        grid_cell: cell of the ``*-grid`` systems (tokens): their servers run with
            ``TANGRAM_GRID_SEGMENTS=1`` and ``--chunked-prefill-size grid_cell``.
        profile_files: which profile file each system read at each ratio (set by :func:`run`
            for the report's ``config.profile_files``; :func:`profile_files`).
        profile_scorer_options: the scorer options those files carry (set by :func:`run` for
            the report's ``config.profile_scorer_options``; :func:`profile_scorer_options`).
    """

    model: str
    model_dir: Path
    profile_dir: Path
    tasks: tuple[str, ...]
    ratios: tuple[float, ...]
    num_samples: int
    lengths: tuple[int, ...]
    depths: tuple[float, ...]
    num_turns: int
    systems: tuple[str, ...]
    seed: int
    json_path: Path | None
    server_args: tuple[str, ...] = ()
    threads: int | None = None
    resume: bool = False
    skip: int = 0
    device: str = "cpu"
    protocol: str = "query-agnostic"
    chunked_prefill_tokens: int = CHUNKED_PREFILL_TOKENS
    grid_cell: int = GRID_CELL_TOKENS
    profile_files: dict[str, dict[str, str]] | None = None
    profile_scorer_options: dict[str, dict[str, dict[str, Any]]] | None = None

    @property
    def dtype(self) -> str:
        """The model dtype of every system on ``device`` (``float32`` / ``bfloat16``)."""
        return DEVICE_DTYPES[self.device]


def profile_candidates(profile_dir: Path, scorer: str) -> dict[float, Path]:
    """The ``<scorer>-r<ratio>.json`` profiles of a folder, by target ratio.

    Files whose ratio part is not a plain decimal in (0, 1] (``kvzip-lite-r0.5.bak.json``) are
    left out; each kept file's ``scorer`` field is read (a JSON read, no model).

    Raises:
        ConfigError: two files for one ratio (``r0.5`` and ``r0.50``), or a file that holds
            another scorer's profile than its name says (it would run as that other scorer).
    """
    found: dict[float, Path] = {}
    for path in sorted(profile_dir.glob(f"{scorer}-r*.json")):
        text = path.stem[len(scorer) + 2 :]
        if not RATIO_NAME.fullmatch(text) or not 0 < float(text) <= 1:
            continue
        ratio = float(text)
        if ratio in found:
            raise ConfigError(
                f"--profile-dir: {found[ratio].name} and {path.name} are both the {scorer} "
                f"profile of ratio {ratio}; keep one"
            )
        try:
            named = json.loads(path.read_text()).get("scorer", scorer)
        except (OSError, ValueError, AttributeError):
            named = scorer  # not a profile at all: BudgetProfile.load says so when it is used
        if named != scorer:
            raise ConfigError(
                f"--profile-dir: {path} holds a profile of scorer {named!r}, not {scorer!r} as "
                f"its name says; rename it or calibrate a {scorer} profile in its place"
            )
        found[ratio] = path
    return found


def nearest_profile_path(profile_dir: Path, ratio: float, scorer: str = "ada-snapkv") -> Path:
    """The ``<scorer>-r<ratio>.json`` file of ``profile_dir`` whose ratio is nearest ``ratio``.

    Raises:
        ConfigError: no such profile in the folder, or a bad one (:func:`profile_candidates`).
    """
    candidates = profile_candidates(profile_dir, scorer)
    if not candidates:
        raise ConfigError(
            f"--profile-dir {profile_dir} holds no {scorer}-r<ratio>.json profile; calibrate "
            f"one (python -m tangram_sglang.calibrate --model-path MODEL --scorer {scorer} "
            f"--target-ratio R --output {profile_dir}/{scorer}-rR.json; calibration/README.md)"
        )
    return candidates[min(candidates, key=lambda r: abs(r - ratio))]


def profile_scorers(systems: tuple[str, ...]) -> dict[str, str]:
    """The scorer of the profiles each selected system reads.

    Args:
        systems: the run's systems (:data:`SYSTEMS` names).

    Returns:
        ``{"budgets": "ada-snapkv", system: scorer, ...}``: ``budgets`` is the Ada-SnapKV
        profile whose kept share the kvpress presses without a profile of their own use
        (``dynamic-ada-snapkv``, ``uniform-snapkv``, ``kvzip``; present only when one of them
        is selected), then each selected Tangram system's scorer (:data:`TANGRAM_SYSTEMS`) and
        profile-budget press's (``PROFILE_BUDGET_SYSTEMS``).
    """
    own = {
        system: scorer
        for system, scorer in (TANGRAM_SYSTEMS | PROFILE_BUDGET_SYSTEMS).items()
        if system in systems
    }
    if any(s in systems and s not in PROFILE_BUDGET_SYSTEMS for s in PRESS_SYSTEMS):
        return {"budgets": "ada-snapkv", **own}
    return own


def profile_files(
    profile_dir: Path, ratios: tuple[float, ...], systems: tuple[str, ...]
) -> dict[str, dict[str, str]]:
    """Which profile file each system reads at each ratio (the report's ``config.profile_files``).

    Args:
        profile_dir: the ``--profile-dir`` folder.
        ratios: the run's kept ratios in (0, 1].
        systems: the run's systems.

    Returns:
        ``{system or "budgets": {str(ratio): path}}`` (:func:`profile_scorers`); a path inside
        this repository is relative to its root (``calibration/smollm2/ada-snapkv-r0.5.json``),
        any other absolute.

    Raises:
        ConfigError: as :func:`nearest_profile_path`.
    """
    return _per_profile(profile_dir, ratios, systems, _shown)


def profile_scorer_options(
    profile_dir: Path, ratios: tuple[float, ...], systems: tuple[str, ...]
) -> dict[str, dict[str, dict[str, Any]]]:
    """The scorer options of each profile file :func:`profile_files` names (the report's
    ``config.profile_scorer_options``), so that a report says which options (``window_share``
    of a changed copy of the profiles...) produced it after the ``--profile-dir`` is gone.

    Returns:
        ``{system or "budgets": {str(ratio): {option: value}}}``, the keys of
        :func:`profile_files` (:func:`recorded_scorer_options`).

    Raises:
        ConfigError: as :func:`nearest_profile_path`, or a bad ``scorer_options``
            (:func:`recorded_scorer_options`).
        ProfileError: a file that is not a valid profile.
    """
    return _per_profile(profile_dir, ratios, systems, recorded_scorer_options)


def _per_profile(
    profile_dir: Path,
    ratios: tuple[float, ...],
    systems: tuple[str, ...],
    read: Callable[[Path], Any],
) -> dict[str, dict[str, Any]]:
    """``read(path)`` of the profile file each system reads at each ratio (the nearest-ratio
    file of its scorer, :func:`profile_scorers` and :func:`nearest_profile_path`), as
    ``{system or "budgets": {str(ratio): read(path)}}``."""
    return {
        system: {str(r): read(nearest_profile_path(profile_dir, r, scorer)) for r in ratios}
        for system, scorer in profile_scorers(systems).items()
    }


def recorded_scorer_options(path: Path) -> dict[str, Any]:
    """The ``provenance.scorer_options`` of the profile at ``path`` as the report records them.

    Every key the file holds, as it holds it: the raw dict rather than
    ``scoring.base.profile_options``' result, which leaves out the keys calibration records
    beside the scorer's own (``alpha_safeguard``, the safeguard that shaped the file's budgets)
    for a scorer without that field; an option the file leaves out runs at the scorer's default
    and is not listed. The names are checked as a server checks them (``profile_options``).
    A value that is not a scalar (``kvzip-gate``'s fitted ``weights``, 50-100 KB of floats per
    file) is recorded as ``sha256:`` and the first 16 hex digits of the SHA-256 of its compact
    JSON (sorted keys): it names those values, and two runs with other ones still differ.

    Raises:
        ConfigError: ``scorer_options`` not a JSON object, or an option name its scorer does not
            know (``profile_options``).
        ProfileError: the file is not a valid profile (``BudgetProfile.load``).
    """
    from tangram_sglang.scoring.base import profile_options

    profile = BudgetProfile.load(path)
    profile_options(profile.scorer, profile.provenance)
    options = profile.provenance.get("scorer_options") or {}
    return {key: _recorded(value) for key, value in options.items()}


def _recorded(value: Any) -> Any:
    """A scalar as it is; any other value as ``sha256:`` and 16 hex digits of its compact JSON."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def _shown(path: Path) -> str:
    """``path`` relative to the repository root when inside it, else absolute."""
    path = path.resolve()
    root = Path(__file__).resolve().parents[2]
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def shipped_profile(
    profile_dir: Path, ratio: float, model_dir: Path, scorer: str = "ada-snapkv"
) -> BudgetProfile:
    """The shipped ``scorer`` profile nearest to ``ratio`` (r0.25 or r0.5), for ``model_dir``.

    Raises:
        ConfigError: no such profile in the folder, or a bad one (:func:`profile_candidates`).
        ProfileError: the profile was calibrated for another model (``check_model``).
    """
    profile = BudgetProfile.load(nearest_profile_path(profile_dir, ratio, scorer))
    local = ModelIdentity.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    profile.check_model(local)
    return profile


def server_flags(cfg: RunConfig, tangram: bool, grid: bool = False) -> list[str]:
    """``launch_server`` flags of one server (before the ``--tangram`` ones): ``--server-args``,
    the chunk size that keeps each compressed part one segment (``cfg.grid_cell`` for a grid
    system: the grid's cell), and on cuda the dtype (``cfg.dtype``) and
    :data:`CUDA_SERVER_FLAGS` (+ :data:`CUDA_STOCK_FLAGS` for a stock server) where
    ``--server-args`` does not set them. On cpu ``SGLangServer`` adds the CPU engine's."""
    args = list(cfg.server_args)
    chunk = cfg.grid_cell if grid else cfg.chunked_prefill_tokens
    args += ["--chunked-prefill-size", str(chunk)]
    if cfg.device == "cuda":
        extra = {"--dtype": cfg.dtype, **CUDA_SERVER_FLAGS, **({} if tangram else CUDA_STOCK_FLAGS)}
        for flag, value in extra.items():
            if flag not in args:
                args += [flag, value]
    return args


def server_env(system: str) -> dict[str, str]:
    """Environment of one system's server over the harness's own: ``TANGRAM_GRID_SEGMENTS`` on
    for the ``*-grid`` systems, off for every other (whatever the harness's environment says)."""
    return {GRID_ENV: "1" if system in GRID_SYSTEMS else "0"}


def run(cfg: RunConfig, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Build the samples, run the systems, score; returns the report dict (see ``report``)."""
    from transformers import AutoTokenizer, GenerationConfig

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    t0 = time.monotonic()
    tok = AutoTokenizer.from_pretrained(cfg.model_dir)
    per_task = [
        build_samples(task, tok, cfg.num_samples, cfg.lengths, cfg.depths, cfg.num_turns, cfg.seed)
        for task in cfg.tasks
    ]
    # tasks interleaved (needle 0, squad 0, multi-turn 0, needle 1, ...): a run cut short still
    # holds every task at nearly the same sample count
    samples = [s for group in zip(*per_task, strict=True) for s in group]
    samples = samples[cfg.skip :]
    prompts = {s.sample_id: for_protocol(conversation_ids(s, tok), cfg.protocol) for s in samples}
    ran = {  # the report's config.profile_files and config.profile_scorer_options
        "profile_files": profile_files(cfg.profile_dir, cfg.ratios, cfg.systems),
        "profile_scorer_options": profile_scorer_options(cfg.profile_dir, cfg.ratios, cfg.systems),
    }
    profiles = {
        r: tangram_profile(shipped_profile(cfg.profile_dir, r, cfg.model_dir), r)
        for r in cfg.ratios
    }
    # each Tangram system's own profile (the Ada-SnapKV one above also sets the presses' budget)
    # and of each press system whose per-head budgets come from a profile (kvzip-budgets...)
    server_profiles = {
        (system, r): tangram_profile(shipped_profile(cfg.profile_dir, r, cfg.model_dir, sc), r)
        for system, sc in (TANGRAM_SYSTEMS | PROFILE_BUDGET_SYSTEMS).items()
        if system in cfg.systems
        for r in cfg.ratios
    }
    eos = GenerationConfig.from_pretrained(cfg.model_dir).eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) | {tok.eos_token_id}
    records, per_ratio = _resumed(cfg, {s.sample_id for s in samples}, log, ran)
    report_cfg = replace(with_resumed_cells(cfg, records), **per_ratio)
    ctx = _Context(
        cfg, tok, samples, prompts, profiles, server_profiles, records, log, t0, report_cfg
    )
    if "full" in cfg.systems:
        ctx.server_phase("full", None)
    for system in TANGRAM_SYSTEMS:
        if system in cfg.systems:
            for ratio in cfg.ratios:
                ctx.server_phase(system, ratio)
    if any(s in cfg.systems for s in (*PRESS_SYSTEMS, "full-hf")):
        ctx.kvpress_phase(eos_ids)
    return ctx.write()


def with_resumed_cells(cfg: RunConfig, records: list[dict[str, Any]]) -> RunConfig:
    """The config the report is built with: ``cfg`` with the ratios and systems of the resumed
    ``records`` added (then ratios high to low, as ``report.merge`` orders them); ``cfg``
    itself when nothing was resumed.

    A ``--resume`` run at one ratio or of one system keeps the file's other cells; without this
    its report would list and summarise only the ratios and systems of the last command (full
    KV's ratio-free records counted at those ratios only). Cells come from the records, so a
    ratio or system the earlier command named but never finished a sample of is not listed.
    """
    if not records:
        return cfg
    ratios = {*cfg.ratios, *(r["ratio"] for r in records if r.get("ratio") is not None)}
    systems = dict.fromkeys([*cfg.systems, *(r["system"] for r in records)])
    return replace(cfg, ratios=tuple(sorted(ratios, reverse=True)), systems=tuple(systems))


def _resumed(
    cfg: RunConfig,
    sample_ids: set[str],
    log: Callable[[str], None],
    ran: dict[str, dict[str, Any] | None] | None = None,
) -> tuple[list[dict], dict[str, dict[str, Any] | None]]:
    """The records of ``cfg.json_path`` to keep when resuming, and what this run recorded of its
    profiles joined with what its report recorded.

    Args:
        ran: ``{field: {system: {ratio: value}}}`` of this run for each
            ``report.PER_RATIO_FIELDS`` field (``profile_files``: :func:`profile_files`;
            ``profile_scorer_options``: :func:`profile_scorer_options`); a field left out: None.

    Returns:
        The kept records, and per field the union of ``ran``'s and the report's ``config``
        (``report.merge_per_ratio``; a report written before the field: ``ran``'s); without
        resuming, no records and ``ran``.

    Raises:
        ConfigError: the report cannot be resumed (another protocol, device or samples, an
            unreadable file), or it read another profile file, or one with other scorer
            options, for a (system, ratio) than this run would.
    """
    ran = {field: (ran or {}).get(field) for field in report.PER_RATIO_FIELDS}
    if not cfg.resume or cfg.json_path is None or not cfg.json_path.is_file():
        return [], ran
    try:
        rep = report.load_report(cfg.json_path)
    except ConfigError as exc:
        raise ConfigError(f"--resume: {exc}; use another --json") from None
    records = rep["records"]
    if not {r["sample_id"] for r in records} <= sample_ids:
        raise ConfigError(f"--resume: {cfg.json_path} holds other samples; use another --json")
    for flag, theirs, mine in (
        ("--protocol", report.protocol_name(rep), cfg.protocol),
        ("--device", report.device_name(rep), cfg.device),
    ):
        if theirs != mine:
            raise ConfigError(
                f"--resume: {cfg.json_path} was run with {flag} {theirs}, not {mine}; "
                "use another --json"
            )
    try:
        merged = {
            field: report.merge_per_ratio([rep["config"].get(field), mine], field)
            for field, mine in ran.items()
        }
    except ConfigError as exc:
        raise ConfigError(
            f"--resume: {cfg.json_path}: {exc}; pass that run's --profile-dir or use another --json"
        ) from None
    missing = [f"config.{field}" for field in ran if rep["config"].get(field) is None]
    if records and missing:
        log(
            f"[eval] {cfg.json_path} predates {' and '.join(missing)}: what its "
            f"{len(records)} records read there is not known"
        )
    log(f"[eval] resuming: {len(records)} records kept from {cfg.json_path}")
    return records, merged


@dataclass
class _Context:
    cfg: RunConfig
    tok: Any
    samples: list[Sample]
    prompts: dict[str, Conversation]
    profiles: dict[float, BudgetProfile]  # the Ada-SnapKV profile per ratio (presses' budget)
    server_profiles: dict[tuple[str, float], BudgetProfile]  # (Tangram system, ratio) -> profile
    records: list[dict[str, Any]]
    log: Callable[[str], None]
    t0: float
    report_cfg: RunConfig  # cfg with the resumed cells' ratios and systems (with_resumed_cells)

    def write(self) -> dict[str, Any]:
        rep = report.build(self.report_cfg, self.samples, self.records, time.monotonic() - self.t0)
        if self.cfg.json_path is not None:
            self.cfg.json_path.parent.mkdir(parents=True, exist_ok=True)
            self.cfg.json_path.write_text(report.dumps(rep))
        return rep

    def server_phase(self, system: str, ratio: float | None) -> None:
        from tangram_sglang.serving import SGLangServer

        todo = [s for s in self.samples if not self._done(system, ratio, s)]
        if not todo:
            return
        grid = system in GRID_SYSTEMS
        args = server_flags(self.cfg, tangram=ratio is not None, grid=grid)
        with tempfile.TemporaryDirectory(prefix="tangram-eval-") as tmp:
            if ratio is not None:
                path = Path(tmp) / f"profile-r{ratio}.json"
                self.server_profiles[(system, ratio)].save(path)
                args = ["--tangram", "--tangram-profile", str(path), *args]
            start = time.monotonic()
            server = SGLangServer(
                self.cfg.model_dir,
                args=args,
                device=self.cfg.device,
                startup_timeout_s=STARTUP_S,
                env=server_env(system),
            )
            with server:
                self.log(f"[eval] {system} r={ratio} server up in {time.monotonic() - start:.0f} s")
                client = ServerClient(server.base_url)
                for sample in todo:
                    self._run_server_sample(client, system, ratio, sample)
                    self.write()  # progress on disk after every sample

    def _run_server_sample(self, client, system, ratio, sample: Sample) -> None:
        start = time.monotonic()
        conv = self.prompts[sample.sample_id]
        n = len(conv.context_ids)
        if len(conv.turn_ids[0]) > n:  # query-agnostic: the context alone, kept in the tree
            client.generate(conv.context_ids, 1)
        profile = None if ratio is None else self.server_profiles[(system, ratio)]
        cell = self.cfg.grid_cell if system in GRID_SYSTEMS else 0
        kept = 1.0 if profile is None else tangram_kept_fraction(profile, n, cell)
        # the context must come from the tree on later turns: all of it, or on the grid its
        # whole cells (a match ending inside the cell a prompt fills is cut back to the cell)
        reused = n // cell * cell if cell else n
        for turn, ids in enumerate(conv.turn_ids):
            out, cached = client.generate(ids, MAX_NEW_TOKENS[sample.task])
            if cached < reused and len(ids) > n:  # (query-aware turn 0 is the compressed one)
                raise TangramError(
                    f"{system} r={ratio} {sample.sample_id} turn {turn}: cached_tokens {cached} < "
                    f"{reused} of the context's {n} tokens: the compressed context was not "
                    "reused from the radix tree (is --disable-radix-cache in --server-args, or "
                    "the KV pool too small?)"
                )
            self._record(system, ratio, sample, turn, conv, ids, out, cached, kept)
        self.log(f"[eval] {system} r={ratio} {sample.sample_id}: {time.monotonic() - start:.0f} s")

    def kvpress_phase(self, eos_ids: set[int]) -> None:
        start = time.monotonic()
        runner = KvpressRunner(str(self.cfg.model_dir), eos_ids, self.cfg.threads, self.cfg.device)
        self.log(f"[eval] transformers model loaded in {time.monotonic() - start:.0f} s")
        press = next((s for s in PRESS_SYSTEMS if s in self.cfg.systems), None)
        first = ("full-hf", None) if press is None else (press, self.cfg.ratios[0])
        for sample in self.samples:
            if self._done(*first, sample):
                continue
            start = time.monotonic()
            conv = self.prompts[sample.sample_id]
            n = len(conv.context_ids)
            kept = {r: tangram_kept_fraction(p, n) for r, p in self.profiles.items()}
            presses = {} if "full-hf" not in self.cfg.systems else {("full-hf", None): None}
            fractions = {}  # (system, ratio) -> kept share of the context
            for system in PRESS_SYSTEMS:
                if system in self.cfg.systems:
                    for r in self.cfg.ratios:
                        budgets = self.server_profiles.get((system, r))
                        frac = kept[r] if budgets is None else tangram_kept_fraction(budgets, n)
                        fractions[(system, r)] = frac
                        presses[(system, r)] = KvpressRunner.make_press(system, 1 - frac, budgets)
            outs = runner.generate(
                conv.context_ids, conv.turn_ids, presses, MAX_NEW_TOKENS[sample.task]
            )
            for (system, r), per_turn in outs.items():
                frac = 1.0 if r is None else fractions[(system, r)]
                for turn, (ids, out) in enumerate(zip(conv.turn_ids, per_turn, strict=True)):
                    # the context's (compressed) cache is reused by construction: cached = n,
                    # except a query-aware turn 0 (its prompt is the compressed prefill: 0)
                    cached = n if len(ids) > n else 0
                    self._record(system, r, sample, turn, conv, ids, out, cached, frac)
                    if r is not None and turn == 0:  # the method's own per-head allocation
                        self.records[-1]["kept_per_head"] = runner.kept_per_head[(system, r)]
            self.log(f"[eval] kvpress {sample.sample_id}: {time.monotonic() - start:.0f} s")
            self.write()

    def _done(self, system: str, ratio: float | None, sample: Sample) -> bool:
        return any(
            r["system"] == system and r["ratio"] == ratio and r["sample_id"] == sample.sample_id
            for r in self.records
        )

    def _record(self, system, ratio, sample, turn, conv, ids, out, cached, kept) -> None:
        text = self.tok.decode(out, skip_special_tokens=True)
        answers = sample.turns[turn].answers
        self.records.append(
            {
                "task": sample.task,
                "sample_id": sample.sample_id,
                "turn": turn,
                "system": system,
                "ratio": ratio,
                "prompt_tokens": len(ids),
                "context_prompt_tokens": len(conv.context_ids),
                "cached_tokens": cached,
                "kept_fraction": round(kept, 4),
                "output_ids": out,
                "prediction": text,
                "answers": list(answers),
                **score(text, answers),
            }
        )
