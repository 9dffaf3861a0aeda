"""Accuracy harness (issue 8): full KV, Tangram and kvpress presses on the same RULER samples.

A leaf like ``bench`` and ``calibrate``: serving code never imports it. Modules: ``tasks``
(samples), ``scoring`` (metrics), ``systems`` (servers, kvpress), ``runner``, ``report``, ``cli``.
"""
