"""Tangram for SGLang: non-uniform (per-KV-head) KV-cache compression for multi-turn serving.

Importing this package patches nothing and touches no GPU. The SGLang integration is loaded by
SGLang's plugin mechanism (entry point ``sglang.srt.plugins``) when a server starts.
"""

__version__ = "0.1.0"
