"""Benchmarks and report tools (leaf package: serving code never imports it)."""
