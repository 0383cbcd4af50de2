"""A/B the quantized GEMV/GEMM: this tree's kernel against the one of a git revision, one process.

    python benchmarks/scripts/quant_gemv_ab.py --base HEAD~1 --threads 1 2

Builds ``kernels/csrc/cpu_quant_linear.cpp`` as it is at ``--base`` under its own op namespace
(``weft_quant_base_<isa>``) beside this tree's build, then, per weight shape of the Llama-3.2-1B
model (2048 x 2048, 512 x 2048, 8192 x 2048, 2048 x 8192 and the 49152 x 2048 LM head; ``--shapes``
for others, the ``smol-*`` ones the default model's) and GGUF format (``--formats``: Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, Q5_0, Q5_1, Q5_K as this
tree packs them, fp16 block scales, the K formats' per super-block; the base build gets every min
stored and the K formats' scales and mins per group in fp32, as the kernels before implied mins and
super-block scales read them, or with ``--same-packs`` this tree's tensors as they are, for a base
that reads them too (Q5_K's fifth bits as per-group words for a base before their bit planes), so
only the code differs; a base without the int5 layout gets Q5_0 as int8,
q - 16, as weft held it before, and cannot run Q5_1 or Q5_K; a base without the int6 layout gets
Q6_K as int8, q - 32, as weft held it before),
times one row of x (or each row count of ``--rows``: batched decode, verify steps) through
``quant_linear_i8`` (the default op) in both builds, alternating base
and new call by call so a change of load on a shared machine hits both. Each call reads the next of
several copies of the matrix (``--stream-bytes`` in all, 256 MiB by default: more than the caches),
so the weights come from memory as in a decode step (``--cpu-time``: timed by the process's CPU
time, for a loaded machine). Prints the best and the
median time of each, the weight bytes each build read per call as GB/s (and, above one row, the
multiply-adds a second, GMAC/s), and the new/base speed ratio of
the medians, next to the read bandwidth measured in the same run (a torch sum over 1 GiB, with the
same thread count). Before timing it checks that both builds give the same bits for every layout at
several row counts (``--no-check`` skips that), so a speed-up that changes numerics shows up (Q5_0
against an int8 base: within 1e-5 of the largest output, the same sums in another order; the formats
of ``--changed``, whose ``quant_linear_i8`` numerics this tree changed, against this tree's twin
within 1e-5 of the largest output).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from kernels import cpu_quant_linear
from kernels.cpu_build import build
from kernels.reference import (
    fifth_bits_per_group,
    has_mins,
    is_int4,
    is_int6,
    packed_values,
    quant_linear_i8_ref,
    super_scales_ref,
)

ROOT = Path(__file__).resolve().parents[2]
SOURCE = "kernels/csrc/cpu_quant_linear.cpp"
SHAPES = {
    "qkvo": (2048, 2048),
    "kv": (512, 2048),
    "up": (8192, 2048),
    "down": (2048, 8192),
    "head": (49152, 2048),
    # The Llama-3.2-3B shape's (hidden 3072, MLP 8192): q and o, gate and up, down.
    "3b-qkvo": (3072, 3072),
    "3b-up": (8192, 3072),
    "3b-down": (3072, 8192),
    # The default model's (SmolLM2-135M: hidden 576, MLP 1536): the fused QKV, o, gate-up, down, head.
    "smol-qkv": (960, 576),
    "smol-o": (576, 576),
    "smol-up": (3072, 576),
    "smol-down": (576, 1536),
    "smol-head": (49152, 576),
    # Gemma 3 270M's (hidden 640, 4 query heads and 1 KV head of 256, MLP 2048): the fused QKV, o,
    # gate-up, down and the output head (vocabulary 262,144; Q8_0 in its Q4_K_M file).
    "gemma-qkv": (1536, 640),
    "gemma-o": (640, 1024),
    "gemma-up": (4096, 640),
    "gemma-down": (640, 2048),
    "gemma-head": (262144, 640),
}


def load_base(revision: str, isa: str):
    """The op namespace of the kernel source at ``revision``, built for ``isa``."""
    text = subprocess.run(
        ["git", "show", f"{revision}:{SOURCE}"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    folder = Path(tempfile.gettempdir()) / "weft_quant_gemv_ab"
    folder.mkdir(exist_ok=True)
    source = folder / "cpu_quant_linear_base.cpp"
    if not source.exists() or source.read_bytes() != text:
        source.write_bytes(text)
    namespace = f"weft_quant_base_{isa}"
    target, _ = cpu_quant_linear.ISAS[isa]
    build(
        "weft_cpu_quant_linear_base",
        source,
        "the base quantized-linear kernel",
        isa=target,
        defines=(f"QUANT_LIBRARY_NS={namespace}",),
    )
    return getattr(torch.ops, namespace)


K_FORMATS = ("Q4_K", "Q5_K", "Q6_K")


def random_bytes(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=g, dtype=torch.int16).to(torch.uint8)


def packed(fmt: str, n: int, k: int, group: int = 32, seed: int = 0):
    """Random weights in weft's packing of ``fmt``: (qweight, scales, mins, group, qhigh), fp16
    scales (``group`` 16 for the int8 layout of Q6_K's kind), qhigh for the int5 formats (Q5_*) and
    the int6 one (Q6_K)."""
    g = torch.Generator().manual_seed(seed)
    if fmt in ("Q4_K", "Q5_K"):
        q = random_bytes((n, k // 2), g)
        halves = (torch.rand(n, k // 256, 2, generator=g) * 0.001).half().view(torch.uint8)  # d, dmin
        sc_m = torch.randint(0, 64, (n, k // 256, 16), generator=g, dtype=torch.int16).to(torch.uint8)
        qhigh = random_bytes((n, k // 8), g) if fmt == "Q5_K" else None
        return q, torch.cat((halves, sc_m), dim=-1), None, 32, qhigh
    if fmt == "Q6_K":
        q, qhigh = random_bytes((n, k // 2), g), random_bytes((n, k // 4), g)
        d = (torch.rand(n, k // 256, 1, generator=g) * 0.001).half().view(torch.uint8)
        sc = torch.randint(-128, 128, (n, k // 256, 16), generator=g, dtype=torch.int16).to(torch.int8)
        return q, torch.cat((d, sc.view(torch.uint8)), dim=-1), None, 16, qhigh
    scales = (torch.rand(n, k // group, generator=g) * 0.02 + 0.001).half()
    if fmt == "Q8_0":
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int16).to(torch.int8)
        return q, scales, None, group, None
    q = random_bytes((n, k // 2), g)
    qhigh = random_bytes((n, k // 8), g) if fmt.startswith("Q5") else None
    mins = None if fmt in ("Q4_0", "Q5_0") else (torch.randn(n, k // 32, generator=g) * 0.02).half()
    return q, scales, mins, 32, qhigh


def has_int5(ns) -> bool:
    """Whether a build's ops take the int5 layout's fifth bits (qhigh)."""
    return "qhigh" in str(ns.quant_linear_i8.default._schema)


def has_int6(ns) -> bool:
    """Whether a build runs the int6 layout (Q6_K's: a uint8 qweight in groups of 16, with qhigh);
    older builds refuse it."""
    if not has_int5(ns):
        return False
    try:
        q, qhigh = torch.zeros(1, 64, dtype=torch.uint8), torch.zeros(1, 32, dtype=torch.uint8)  # K 128
        ns.quant_linear_i8(torch.zeros(1, 128), q, torch.ones(1, 8), None, 16, torch.empty(1, 1), qhigh)
    except RuntimeError:
        return False
    return True


def reads_fifth_planes(ns) -> bool:
    """Whether a build reads Q5_K's fifth bits beside its records as bit planes (this tree) rather
    than per-group words (before): one set bit, byte 16 bit 0, is element 32 as planes, 128 as words."""
    q, qhigh = torch.zeros(1, 128, dtype=torch.uint8), torch.zeros(1, 32, dtype=torch.uint8)
    qhigh[0, 16] = 1
    halves = torch.tensor([1.0, 0.0]).half().view(torch.uint8)  # d 1, dmin 0
    records = torch.cat((halves, torch.tensor([1] * 8 + [0] * 8, dtype=torch.uint8))).view(1, 1, 20)
    x, out = torch.zeros(1, 256), torch.empty(1, 1)
    x[0, 32] = 1.0
    try:
        ns.quant_linear_i8(x, q, records, None, 32, out, qhigh)
    except RuntimeError:  # a base without records or int5
        return False
    return out.item() != 0


def as_base_reads(pack, planes: bool):
    """``pack`` as it is (``--same-packs``), but for Q5_K with its records and a base that reads the
    fifth bits per group, those words instead of the bit planes (the same weights)."""
    q, scales, mins, group, qhigh = pack
    if planes or qhigh is None or scales.dim() != 3 or is_int6(q, group):
        return pack
    return q, scales, mins, group, fifth_bits_per_group(qhigh)


def stored(pack, int5: bool = True, int6: bool = True):
    """``pack`` with every int4 min stored (Q4_0's -8 d) and scales per group (the K formats' fp32
    products), as a base kernel of any revision reads it; without ``int5`` (a base older than the
    layout) Q5_0 as int8, q - 16 (the values, exact, with the same fp16 scales); without ``int6``
    Q6_K as int8, q - 32."""
    q, scales, mins, group, qhigh = pack
    if qhigh is not None and is_int6(q, group) and not int6:
        q, qhigh = packed_values(q, group, qhigh).flatten(1), None  # int8 q - 32, [N, K]
    if qhigh is not None and not int5:
        if mins is not None or scales.dim() == 3:
            raise SystemExit("the base kernel has no int5 layout: it can run Q5_0 (as int8) only")
        return (packed_values(q, group, qhigh).to(torch.int8) - 16).flatten(1), scales, None, group, None
    if scales.dim() == 3:
        if qhigh is not None and not is_int6(q, group):  # Q5_K: per-group words go with per-group scales
            qhigh = fifth_bits_per_group(qhigh)
        return q, *super_scales_ref(scales, has_mins(q, group), group), group, qhigh
    if mins is None and is_int4(q):
        factor = -8 if qhigh is None else -16  # exact: no test scale is near fp16's range end
        mins = (scales.float() * factor).to(scales.dtype)
    return q, scales, mins, group, qhigh


def call(ns, op: str, x: torch.Tensor, pack, out: torch.Tensor) -> None:
    """``op`` of build ``ns`` on a pack of ``packed``'s form (its qhigh only where there is one, so
    a base without the argument runs the other layouts)."""
    q, scales, mins, group, qhigh = pack
    getattr(ns, op)(x, q, scales, mins, group, out, *([] if qhigh is None else [qhigh]))


def nbytes(*tensors) -> int:
    return sum(t.nbytes for t in tensors if t is not None)


def check_bits(base, new, changed: tuple[str, ...] = (), same_packs: bool = False) -> None:
    """Both builds give the same bits, i8 and i16, at row counts that take every tile shape (Q5_0
    against a base without int5, which holds it as int8: within 1e-5 of the largest output), the
    base on ``stored`` packs or (``same_packs``) on this tree's (``as_base_reads``). The
    formats of ``changed`` (numerics changed on purpose, e.g. Q4_K and Q5_K rounding x per 256 in
    ``quant_linear_i8``) are checked in that op against this tree's twin, ``quant_linear_i8_ref``,
    within 1e-5 of the largest output instead."""
    int5, int6, planes = has_int5(base), has_int6(base), reads_fifth_planes(base)
    formats = [("Q4_0", False), ("Q4_1", False), ("Q8_0", False), ("Q8_0", True), ("Q4_K", False)]
    formats += [("Q6_K", False), ("Q5_0", False)]
    if int5:
        formats += [("Q5_1", False), ("Q5_K", False)]
    for fmt, group16 in formats:
        k = 560 if group16 else 768 if fmt in K_FORMATS else 576
        q, s16, m16, group, qhigh = packed(fmt, 203, k, 16) if group16 else packed(fmt, 203, k)
        kinds = (
            [(s16, m16)]
            if fmt in K_FORMATS
            else [(s16, m16), (s16.float(), None if m16 is None else m16.float())]
        )
        for (s, m), rows in itertools.product(kinds, (1, 2, 3, 4, 5, 7, 9, 33)):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            pack = (q, s, m, group, qhigh)
            packs = {
                "base": as_base_reads(pack, planes) if same_packs else stored(pack, int5, int6),
                "new": pack,
            }
            for op in ("quant_linear_i8", "quant_linear_i16"):
                for single in (True, False):
                    base.set_single_row_blocks(single)
                    new.set_single_row_blocks(single)
                    outs = []
                    for label, ns in (("base", base), ("new", new)):
                        out = torch.empty(rows, q.shape[0])
                        call(ns, op, x, packs[label], out)
                        outs.append(out)
                    if fmt in changed and op == "quant_linear_i8":
                        outs[0] = quant_linear_i8_ref(x, q, s, m, group, qhigh=qhigh)
                    diff = (outs[0] - outs[1]).abs().max().item()
                    loose = fmt in changed and op == "quant_linear_i8" or not int5 and fmt == "Q5_0"
                    bound = 1e-5 * outs[0].abs().max().item() if loose else 0.0
                    if diff > bound or not torch.equal(outs[0].isnan(), outs[1].isnan()):
                        raise SystemExit(
                            f"bits differ: {fmt} group {group} rows {rows} {op} single={single}: {diff}"
                        )
    base.set_single_row_blocks(True)
    new.set_single_row_blocks(True)
    q5 = "Q5_0, Q5_1, Q5_K" if int5 else "and Q5_0 (base int8, within 1e-5)"
    packs = "this tree's packs" + ("" if planes else " (Q5_K's fifth bits per group for the base)")
    print(
        "same bits: base and new, i8 and i16, Q4_0/Q4_1/Q8_0 (group 32 and 16), fp16 and fp32 scales, "
        f"Q4_K, Q6_K, {q5}, rows 1-33, the base on "
        + (packs if same_packs else "per-group scales")
        + (f"; except {', '.join(changed)} in i8: new within 1e-5 of the twin" if changed else "")
    )


def read_bandwidth(size: int = 1 << 30, repeats: int = 5) -> float:
    buf = torch.ones(size // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return size / best


def bench(base, new, threads: int, args) -> None:
    torch.set_num_threads(threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    bandwidth = read_bandwidth()
    print(f"\nthreads {threads}: torch sum over 1 GiB {bandwidth / 1e9:.1f} GB/s")
    print(
        f"  {'format':5s} {'shape':14s} {'rows':>4s} {'MB base':>7s} {'new':>6s} {'base ms':>8s} {'new ms':>8s} "
        f"{'base GB/s':>9s} {'new GB/s':>9s} {'GMAC/s base':>11s} {'new':>6s} {'new/base':>8s}"
    )
    int5, int6, planes = has_int5(base), has_int6(base), reads_fifth_planes(base)

    def for_base(pack):
        return as_base_reads(pack, planes) if args.same_packs else stored(pack, int5, int6)

    for fmt, name, rows in itertools.product(args.formats, args.shapes, args.rows):
        n, k = SHAPES[name]
        first = packed(fmt, n, k)
        base_first = for_base(first)
        size = {"base": nbytes(*base_first[:3], base_first[4]), "new": nbytes(*first[:3], first[4])}
        # Copies of the matrix cycled through, more bytes than the caches hold: each call reads
        # its weights from memory, as a decode step does (every matrix of a model read once).
        copies = [first] + [
            packed(fmt, n, k, seed=i) for i in range(1, -(-args.stream_bytes // size["base"]))
        ]
        mats = {"base": [for_base(c) for c in copies], "new": copies}
        x = torch.randn(rows, k)
        out = torch.empty(rows, n)
        times = {"base": [], "new": []}
        for label, ns in (("base", base), ("new", new)):  # warm-up (page faults)
            for mat in mats[label]:
                call(ns, "quant_linear_i8", x, mat, out)
        for step in range(args.calls):
            for label, ns in (("base", base), ("new", new)):
                mat = mats[label][(2 * step + (label == "new")) % len(copies)]
                start = clock()
                call(ns, "quant_linear_i8", x, mat, out)
                times[label].append(clock() - start)
        del mats, copies
        med = {label: statistics.median(t) for label, t in times.items()}
        macs = rows * n * k
        print(
            f"  {fmt:5s} {name:5s} {n:5d}x{k:<5d} {rows:4d} {size['base'] / 1e6:7.1f} {size['new'] / 1e6:6.1f} "
            f"{med['base'] * 1e3:8.3f} {med['new'] * 1e3:8.3f} "
            f"{size['base'] / med['base'] / 1e9:9.1f} {size['new'] / med['new'] / 1e9:9.1f} "
            f"{macs / med['base'] / 1e9:11.1f} {macs / med['new'] / 1e9:6.1f} "
            f"{med['base'] / med['new']:7.2f}x  (best {min(times['base']) * 1e3:.3f} / "
            f"{min(times['new']) * 1e3:.3f} ms)"
        )
    print(f"  torch sum over 1 GiB again: {read_bandwidth() / 1e9:.1f} GB/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="HEAD", help="git revision of the base kernel source")
    parser.add_argument("--isa", default=None, help="build to compare (default: the fastest this CPU runs)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--shapes", nargs="+", default=["qkvo", "kv", "up", "down", "head"], choices=list(SHAPES)
    )
    parser.add_argument(
        "--formats",
        nargs="+",
        default=["Q4_0", "Q4_1", "Q8_0"],
        choices=["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q5_0", "Q5_1", "Q5_K"],
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1], help="rows of x per call (M)")
    parser.add_argument("--calls", type=int, default=200, help="timed calls of each build per shape")
    parser.add_argument(
        "--stream-bytes",
        type=int,
        default=256 << 20,
        help="bytes of weight copies cycled through (0: one matrix, cache-resident when small)",
    )
    parser.add_argument("--no-check", action="store_true", help="skip the same-bits check")
    parser.add_argument(
        "--changed",
        nargs="+",
        default=[],
        choices=["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q5_0", "Q5_1", "Q5_K"],
        help="formats whose quant_linear_i8 numerics this tree changed on purpose (Q4_K and Q5_K against "
        "a base before their per-256 rounding of x): checked against this tree's twin within 1e-5 of the "
        "largest output instead of bit for bit against the base",
    )
    parser.add_argument(
        "--same-packs",
        action="store_true",
        help="time (and check) the base on this tree's packed tensors as they are (implied mins, fp16 "
        "scales, super-block records: a base that reads them; Q5_K's fifth bits per group for a base "
        "before its bit planes), so only the code differs",
    )
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time calls by the process's CPU time, not the wall clock: on a shared, loaded machine "
        "the time a call spends descheduled is left out (with one thread, what a quiet machine's "
        "wall clock would read; with more, the threads' CPU time summed)",
    )
    args = parser.parse_args()
    isa = args.isa or cpu_quant_linear.supported_isas()[0]
    base, new = load_base(args.base, isa), cpu_quant_linear.load(isa)
    print(f"base {args.base} vs this tree, {isa} build, quant_linear_i8 at {args.rows} rows of x")
    if not args.no_check:
        check_bits(base, new, tuple(args.changed), args.same_packs)
    with torch.inference_mode():
        for threads in args.threads:
            bench(base, new, threads, args)


if __name__ == "__main__":
    main()
