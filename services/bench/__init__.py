"""Benchmarks behind ``weft bench`` (see ``services.bench.cli``)."""
