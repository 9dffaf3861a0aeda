"""The ``tangram`` attention backend: per-batch plan (metadata) + per-layer compressed attention.

``state.TangramState`` (no sglang import) owns a server's pool, side tables and per-row
bookkeeping; ``metadata`` builds the per-batch tensors once; ``compress`` picks each KV head's
kept tokens of a segment; ``attention_backend.TangramAttnBackend`` is the SGLang
``AttentionBackend`` that drives them. Importing this package registers nothing: the plugin
imports ``attention_backend`` (its ``REGISTRATIONS`` row), which registers ``"tangram"``.
"""
