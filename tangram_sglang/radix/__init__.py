"""Radix-tree reuse of compressed history across turns (docs/design.md §5).

``segment`` (no sglang): a boundary node's :class:`SegmentValue` and chain -> PrefixMatch;
``cache``: :class:`TangramRadixCache` (SGLang ``RadixCache`` subclass); ``factory``: registers
it as ``--radix-cache-backend tangram`` on import.
"""
