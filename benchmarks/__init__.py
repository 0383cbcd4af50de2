"""weft's benchmarks, outside the product: the ``weft bench`` subcommands (``benchmarks.bench``),
the serve-stack harness they and the tests start (``benchmarks.stack``), and, as data beside them,
workloads, peers' scripts, one-off measurement programs (``scripts/``) and dated results.

``benchmarks/README.md`` lists each command and script with what it measures. The product
(``services``, ``kernels``, ``protocol``) never imports this package; only the ``weft`` command's
dispatcher does, lazily, when ``weft bench`` runs or its help is shown.
"""

from pathlib import Path

# This folder: its data (workloads/, peers/) beside the code, in a checkout and in the wheel.
BENCHMARKS_DIR = Path(__file__).resolve().parent
