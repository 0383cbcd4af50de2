"""What this CPU's AVX2 (and AVX-512 VNNI) vector pipes issue per cycle, alone and in the int8 GEMMs' mixes.

Compiles ``benchmarks/scripts/vector_ops.c`` with the machine's C compiler into a temporary folder and runs
it on one core: the clock from a chain of dependent adds, then ops per cycle for single
instructions and, for three ways to multiply int8 on AVX2, the products a cycle and the cycles 256
products take (weft's signed tile, 7-bit x made unsigned, int16 pairs). It measures the instruction
mix of ``kernels/csrc/cpu_avx2_int8.cpp``'s register tile with its operands in registers: the
bound the GEMM meets on long steps; and the packed kernel's int4 tile per pair of blocks and row of
x (``quant_linear_i8``, x from L1), with and without its fp32 tail: the bound of a batched step on
the default path (compare with ``quant_gemv_ab.py --rows 16``'s GMAC/s over this clock). Where
the CPU has AVX-512 BW and VNNI, also ``vpdpbusd`` on 256 and 512 bits, ``vpmaddubsw`` and
``vpdpwssd`` on 512, and the AVX-512 super-block tile's mix per pair of groups.

Usage: ``python benchmarks/scripts/vector_ops_bench.py [--cc gcc]``
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("vector_ops.c")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cc", default="gcc", help="C compiler (default gcc)")
    args = parser.parse_args()
    flags = next(
        (
            line.partition(":")[2].split()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        ),
        [],
    )
    if "avx2" not in flags:
        raise SystemExit("this CPU has no AVX2: nothing to measure")
    simd = [f for f in flags if f.startswith(("avx", "amx", "fma"))]
    print("CPU flags:", " ".join(simd))
    with tempfile.TemporaryDirectory() as folder:
        binary = Path(folder) / "vector_ops"
        subprocess.run([args.cc, "-O2", "-mavx2", "-o", str(binary), str(SOURCE)], check=True)
        # The 512-bit cases only where the CPU runs them (the assembler takes them either way).
        avx512 = ["avx512"] if {"avx512bw", "avx512_vnni"} <= set(flags) else []
        subprocess.run(["taskset", "-c", "0", str(binary), *avx512], check=True)


if __name__ == "__main__":
    main()
