"""Building weft's C++ CPU kernels (``kernels/csrc/``) with the machine's compiler.

One recipe for every kernel library: ``torch.utils.cpp_extension`` with
ninja and the system C++ compiler, OpenMP, and AVX2 + FMA where the CPU has
them (a library may ask for another target, as the quantized matmul does for
AVX-512 VNNI: each target builds under its own name). The build is cached by
torch (later processes load it; concurrent builders wait on one lock, and
a lock left by a process killed mid-build is cleared: ``build_lock``). A
build that cannot happen raises ``KernelUnavailable`` with the reason, and
the caller falls back to torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

# The CPU's flags, and what each build needs of them, are kernels/cpu_caps.py's; the kernel
# wrappers import them from here beside the builds' compiler flags.
from kernels.cpu_caps import AMX_BF16_FLAGS, AVX2_FLAGS, AVX512_BF16_FLAGS, AVX512_FLAGS, cpu_flags, has_all
from kernels.cpu_caps import AMX_INT8_FLAGS as AMX_INT8_FLAGS
from kernels.cpu_caps import AVX512_VNNI_FLAGS as AVX512_VNNI_FLAGS
from services import env

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"


class KernelUnavailable(RuntimeError):
    """The kernel could not be built or loaded here."""


# AVX-512 with VNNI (AVX512_VNNI_FLAGS) for the kernels that use integer dot products.
AVX512_VNNI = (
    "avx512vnni",
    ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"],
)


def target_isa() -> tuple[str, list[str]]:
    """(name, compiler flags) of the instruction set the build targets.

    AVX2 + FMA where the CPU has them, not ``-march=native``: a build (in a
    Docker image, or a home directory shared between machines) may run on
    another CPU than the one that built it. The kernels are bound by memory
    traffic, and AVX-512 measured no faster here. Each target builds under
    its own name, so builds for different CPUs do not replace each other.
    """
    if has_all(AVX2_FLAGS):
        return "avx2", ["-mavx2", "-mfma", "-mf16c"]
    return "generic", []


# AVX-512 (F, VL, BW) for kernels whose loops want its 32 vector registers even on 256-bit
# vectors (the attention kernel keeps every query head's chunks in registers: about 1.4x the
# AVX2 build's speed on cached keys here).
AVX512 = ("avx512", ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl"])


def wide_isa() -> tuple[str, list[str]]:
    """``AVX512`` where the CPU has its flags, else ``target_isa()``."""
    if has_all(AVX512_FLAGS):
        return AVX512
    return target_isa()


# AVX512 plus AVX512_BF16 (vdpbf16ps: bf16 pair dot products into fp32) for the attention kernel's
# bf16 prefills; only kernels that guard their bf16 code with __AVX512BF16__ ask for it.
AVX512_BF16 = ("avx512bf16", [*AVX512[1], "-mavx512bf16"])


def bf16_isa() -> tuple[str, list[str]]:
    """``AVX512_BF16`` where the CPU has its flags, else ``wide_isa()``."""
    if has_all(AVX512_BF16_FLAGS):
        return AVX512_BF16
    return wide_isa()


# AVX512_BF16 plus AMX tiles with bf16 products (tdpbf16ps) for the attention kernel's bf16 prefills;
# its code guards them with __AMX_TILE__ and __AMX_BF16__.
AMX_BF16 = ("amxbf16", [*AVX512_BF16[1], "-mamx-tile", "-mamx-bf16"])


def amx_isa() -> tuple[str, list[str]]:
    """``AMX_BF16`` where the CPU has its flags, else ``bf16_isa()``."""
    if has_all(AMX_BF16_FLAGS):
        return AMX_BF16
    return bf16_isa()


# AVX512 plus AMX tiles with int8 products (tdpbssd) for the int8 linear's integer GEMM.
AMX_INT8 = ("amxint8", [*AVX512[1], "-mamx-tile", "-mamx-int8"])


def stable_source(source: Path, build_name: str, build_root: str) -> Path:
    """A copy of ``source`` at a path that depends only on the build, not on where the checkout is,
    with the headers beside it (``csrc/*.h``, which sources include by their bare name).

    The build's ninja file names its source by path, so the same file in another clone (a CI
    clone, a git worktree) would rebuild the library and replace the other's; built from this copy,
    every checkout with the same source text shares one build. A copy is rewritten only when the
    text differs (an untouched file keeps its time stamp, so ninja builds nothing; the build tracks
    the headers it includes, so a changed header rebuilds what includes it)."""
    folder = Path(build_root) / "sources" / build_name
    for header in sorted(source.parent.glob("*.h")):
        _copy_if_changed(header, folder / header.name)
    return _copy_if_changed(source, folder / source.name)


def stable_sources(sources: Sequence[Path], build_name: str, build_root: str) -> list[Path]:
    """``stable_source`` of each of a library's source files, in one folder (the headers beside them
    once). The headers are not named to torch: ninja finds them through the compiler's list of what
    each file included, and rebuilds the files that include one whose text changed."""
    return [stable_source(source, build_name, build_root) for source in sources]


def _copy_if_changed(source: Path, copy: Path) -> Path:
    text = source.read_bytes()
    if not copy.exists() or copy.read_bytes() != text:
        copy.parent.mkdir(parents=True, exist_ok=True)
        scratch = copy.with_name(f".{copy.name}.{os.getpid()}")
        scratch.write_bytes(text)
        os.replace(scratch, copy)  # atomic: a concurrent build reads the old text or the new
    return copy


def install_tag() -> str:
    """Eight hex digits naming the torch install a build links against: torch's version, its C++
    ABI and include folders, and Python's version. A build's folder carries it, so each install
    builds its kernels once, in a folder of its own: a second virtual environment on the machine
    neither rebuilds the first's kernels at every start (ninja rebuilds when a build's command line,
    which names the include folders, changes) nor loads a library built against another torch."""
    return _install_tag()


@functools.cache
def _install_tag() -> str:
    import torch
    from torch.utils import cpp_extension

    return tag_of(
        [torch.__version__, str(torch._C._GLIBCXX_USE_CXX11_ABI), sys.version, *cpp_extension.include_paths()]
    )


def tag_of(parts: list[str]) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:8]


def build_name(name: str, isa: str) -> str:
    """The folder (and library) name of ``name``'s build for ``isa`` in this torch install."""
    return f"{name}_{isa}_{install_tag()}"


def build_folder(build: str) -> Path:
    """Where torch builds ``build``: under ``TORCH_EXTENSIONS_DIR`` when set, else under the
    default root's folder for this Python and accelerator (``py311_cpu``), as torch's own
    ``_get_build_directory`` names it (without making the folder)."""
    import torch

    root = env.get_raw("TORCH_EXTENSIONS_DIR")
    if root is None:
        if torch.version.hip is not None:
            accelerator = f"rocm{torch.version.hip.replace('.', '')}"
        elif torch.version.cuda is not None:
            accelerator = f"cu{torch.version.cuda.replace('.', '')}"
        else:
            accelerator = "cpu"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(extensions_root(), f"{python}_{accelerator}")
    return Path(root) / build


def extensions_root() -> str:
    """Where torch keeps the builds: ``TORCH_EXTENSIONS_DIR`` when set, as torch's own builds honour
    it, so that a checkout given one of its own (to measure two versions of a kernel, or to build
    a changed source beside the shared one) shares neither the builds nor their source copies."""
    from torch.utils import cpp_extension

    return env.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()


def build(
    name: str,
    source: Path | Sequence[Path],
    what: str,
    isa: tuple[str, list[str]] | None = None,
    defines: tuple[str, ...] = (),
) -> None:
    """Build (or load the cached build of) ``source`` (one file, or the files of one library, which
    ninja compiles side by side) as ``{name}_{isa}``, which registers its ops with torch; ``what``
    names it in the errors ("the CPU attention kernel"). ``isa`` (name, flags) replaces
    ``target_isa()``; ``defines`` go to the compiler as ``-D``."""
    sources = [source] if isinstance(source, Path) else list(source)
    from torch.utils import cpp_extension

    # The venv's ninja, when weft is run through .venv/bin/python without activating it.
    bin_dir = os.path.dirname(sys.executable)
    path = env.get_raw("PATH", "")
    if bin_dir not in path.split(os.pathsep):
        env.put("PATH", bin_dir + os.pathsep + path)
    missing = [tool for tool in ("ninja", env.get_raw("CXX", "c++")) if shutil.which(tool) is None]
    if missing:
        raise KernelUnavailable(f"building {what} needs {' and '.join(missing)} on PATH.")
    isa, isa_flags = isa or target_isa()
    build = build_name(name, isa)
    try:
        with build_lock(build):
            built_before = (build_folder(build) / f"{build}.so").exists()
            if not built_before:
                logger.info("Building %s for %s (once per torch install) ...", what, isa)
            start = time.monotonic()
            _load(cpp_extension, build, sources, isa_flags, defines)
            if not built_before:
                logger.info("Built %s in %.0f s.", what, time.monotonic() - start)
            else:
                logger.info("Loaded %s for %s, built before, in %.1f s.", what, isa, time.monotonic() - start)
    except Exception as exc:  # compiler or linker errors come as several exception types
        raise KernelUnavailable(f"building {what} failed: {exc}") from exc


@contextlib.contextmanager
def build_lock(build_name: str) -> Iterator[None]:
    """Held around torch's build and load of ``build_name``.

    torch's own lock is a file, ``lock`` in the build's folder, created exclusively and removed
    when the build ends. A process killed in between (an engine stopped while it loaded its kernels
    at start-up) leaves it behind, and every later load of that build waits on it for ever. This
    lock is an flock on a file beside the folder, which the OS drops with its holder: whoever holds
    it is the only weft process inside torch's lock, so a ``lock`` file found then is a dead
    process's, and is removed."""
    folder = build_folder(build_name)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{build_name}.weft-lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = folder / "lock"
            if stale.exists():
                logger.warning("Removing %s, left by a process stopped while it built %s.", stale, build_name)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _load(
    cpp_extension, build: str, sources: list[Path], isa_flags: list[str], defines: tuple[str, ...]
) -> None:
    cpp_extension.load(
        name=build,
        sources=[str(copy) for copy in stable_sources(sources, build, extensions_root())],
        # -fopenmp: at::parallel_for's OpenMP pragmas live in ATen's headers and need it
        # here; the library then uses the libgomp torch has already loaded.
        # -fno-trapping-math: nothing here reads floating-point exception flags, and with
        # them assumed to matter GCC keeps a clamp (min/max) as a branch, so a loop over
        # exp (SiLU) stays scalar. Results are unchanged: no operation is reordered.
        extra_cflags=[
            "-O3",
            "-fopenmp",
            "-fno-math-errno",
            "-fno-trapping-math",
            *isa_flags,
            *(f"-D{d}" for d in defines),
        ],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )


def build_for_flags(
    name: str, source: Path, what: str, flags: tuple[str, ...], isa: tuple[str, list[str]]
) -> None:
    """``build`` where the CPU has every one of ``flags``; else ``KernelUnavailable`` naming the
    ones it lacks."""
    missing = [flag for flag in flags if flag not in cpu_flags()]
    if missing:
        raise KernelUnavailable(f"{what} needs CPU flags this CPU lacks: {', '.join(missing)}")
    build(name, source, what, isa=isa)


def loaded_if_on(env_name: str, load, what: str, logger):
    """``load()``'s ops where the switch ``env_name`` is on and the kernel builds here; else None,
    with the reason logged (a kernel's ``available()`` starts here)."""
    if not switch_on(env_name):
        logger.info("%s off (%s=0).", what, env_name)
        return None
    try:
        return load()
    except KernelUnavailable as exc:
        logger.info("%s.", exc)
        return None


def switch_on(env_name: str) -> bool:
    """A kernel's on/off switch in the environment (declared in ``services/env.py``, read through
    it): "1" (the default) or "0"; else ValueError."""
    value = env.get_raw(env_name, "1").strip().lower()
    if value not in ("0", "1"):
        raise ValueError(f"{env_name} must be 0 or 1, got {value!r}.")
    return value == "1"


def build_command(load, what: str, isa_name: str) -> int:
    """``python -m kernels.<module>`` (make install): build where the CPU has the kernel's flags,
    elsewhere say why not, and succeed either way."""
    try:
        load()
    except KernelUnavailable as exc:
        print(f"not built: {exc}")
        return 0
    print(f"built and loaded {what} ({isa_name})")
    return 0
