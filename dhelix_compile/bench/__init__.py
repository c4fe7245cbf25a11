"""Benchmark helpers for dhelix (``link``: launch ranks joined by an emulated slow link)."""
