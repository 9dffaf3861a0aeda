"""Token scorers: which tokens of a segment each KV head keeps (per layer, at prefill).

Public names: :class:`Scorer`, :func:`get_scorer`, :func:`register_scorer`,
:func:`available_scorers`, :func:`select_kept`, and the built-in scorers
:class:`SnapKVScorer`, :class:`AdaSnapKVScorer`, :class:`PyramidKVScorer`, :class:`DuoScorer`,
:class:`KVzipLiteScorer`, :class:`KVzipGateScorer` and :class:`ReplayScorer` (query-agnostic;
the gate needs weights fitted by ``calibrate``, the replay the model's RoPE, :func:`bind_rope`).
"""

from tangram_sglang.scoring.ada_snapkv import AdaSnapKVScorer, adaptive_select
from tangram_sglang.scoring.base import Scorer, available_scorers, get_scorer, register_scorer
from tangram_sglang.scoring.duo import DuoScorer
from tangram_sglang.scoring.kvzip_gate import KVzipGateScorer, is_token_scorer
from tangram_sglang.scoring.kvzip_lite import KVzipLiteScorer
from tangram_sglang.scoring.pyramidkv import PyramidKVScorer, pyramid_layer_budget
from tangram_sglang.scoring.replay import (
    ReplayScorer,
    RopeShift,
    bind_rope,
    needs_rope,
    rope_from_hf,
)
from tangram_sglang.scoring.select import protected_mask, select_kept
from tangram_sglang.scoring.snapkv import SnapKVScorer

__all__ = [
    "AdaSnapKVScorer",
    "DuoScorer",
    "KVzipGateScorer",
    "KVzipLiteScorer",
    "PyramidKVScorer",
    "ReplayScorer",
    "RopeShift",
    "Scorer",
    "SnapKVScorer",
    "adaptive_select",
    "available_scorers",
    "bind_rope",
    "get_scorer",
    "is_token_scorer",
    "needs_rope",
    "protected_mask",
    "pyramid_layer_budget",
    "register_scorer",
    "rope_from_hf",
    "select_kept",
]
