"""The ``weft bench`` subcommands, one module each (the table is ``benchmarks.bench.cli``)."""
