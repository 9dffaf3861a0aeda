"""SGLang-facing layer of Tangram: flags, start-up validation, the plugin and its hooks.

Importing this package imports no ``sglang`` module; ``plugin.register`` (the
``sglang.srt.plugins`` entry point) does, when SGLang loads its plugins. See ``README.md`` here for
the SGLang 0.5.17 seams Tangram uses.
"""
