"""Soak and chaos test of a weft serve stack; see services/bench/soak.py.

    python scripts/soak.py --duration 600 --chaos-interval 15
    python scripts/soak.py --duration 60 --model /path/to/model -- --max-num-seqs 32

Exit code 0 when nothing was lost or leaked, no error fell outside the chaos
windows, every killed rank served again and no engine process outlived the API.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from services.bench.soak import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
