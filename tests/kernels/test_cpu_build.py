"""kernels/cpu_build.py: the source a CPU kernel is built from sits at a path of the build's own,
so checkouts in different folders share one build instead of rebuilding each other's; and a build
lock left by a process killed mid-build does not stop later builds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kernels.cpu_build import build_folder, build_lock, build_name, install_tag, stable_source, tag_of

REPO = Path(__file__).resolve().parents[2]


def test_two_checkouts_of_the_same_source_build_from_one_copy(tmp_path):
    root = tmp_path / "extensions"
    a, b = tmp_path / "clone-a" / "k.cpp", tmp_path / "clone-b" / "k.cpp"
    for path in (a, b):
        path.parent.mkdir()
        path.write_text("int f() { return 1; }\n")
    copy = stable_source(a, "weft_k_avx2", str(root))
    assert copy == root / "sources" / "weft_k_avx2" / "k.cpp" and copy.read_text() == a.read_text()
    os.utime(copy, (1_000_000, 1_000_000))
    assert stable_source(b, "weft_k_avx2", str(root)) == copy
    assert copy.stat().st_mtime == 1_000_000  # same text: untouched, so ninja has nothing to rebuild
    assert [p.name for p in copy.parent.iterdir()] == ["k.cpp"]  # no scratch file left behind


def test_changed_source_text_replaces_the_copy_and_builds_stay_apart(tmp_path):
    root = tmp_path / "extensions"
    source = tmp_path / "k.cpp"
    source.write_text("int f() { return 1; }\n")
    copy = stable_source(source, "weft_k_avx2", str(root))
    source.write_text("int f() { return 2; }\n")
    assert stable_source(source, "weft_k_avx2", str(root)).read_text() == "int f() { return 2; }\n"
    other = stable_source(source, "weft_k_generic", str(root))
    assert other != copy and other.parent.name == "weft_k_generic"


def test_extensions_root_follows_torch_extensions_dir(monkeypatch, tmp_path):
    """A checkout given its own TORCH_EXTENSIONS_DIR keeps its source copies there too: with them in
    the shared root, two checkouts' texts under one build name would replace each other's."""
    from torch.utils import cpp_extension

    from kernels.cpu_build import extensions_root

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert extensions_root() == str(tmp_path)
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert extensions_root() == cpp_extension.get_default_build_root()


def test_a_lock_file_left_behind_is_removed_under_the_build_lock(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale = tmp_path / "weft_k_avx2" / "lock"
    stale.parent.mkdir()
    stale.touch()
    with build_lock("weft_k_avx2"):
        assert not stale.exists()
    assert "left by a process stopped while it built weft_k_avx2" in caplog.text
    with build_lock("weft_k_generic"):  # no lock file: nothing to remove, and no folder made
        assert not (tmp_path / "weft_k_generic").exists()


def test_a_build_after_a_killed_one_does_not_wait_for_ever(tmp_path):
    """torch's lock file as a killed build leaves it: torch alone would wait on it for ever, so the
    build runs in a child with a deadline."""
    source = tmp_path / "probe.cpp"
    source.write_text('extern "C" int weft_probe() { return 7; }\n')
    extensions = tmp_path / "extensions"
    build = build_name("weft_probe", "plain")
    (extensions / build).mkdir(parents=True)
    (extensions / build / "lock").touch()
    code = (
        "from pathlib import Path; from kernels.cpu_build import build; "
        f"build('weft_probe', Path({str(source)!r}), 'the probe', isa=('plain', []))"
    )
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], env=env, timeout=300, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (extensions / build / f"{build}.so").exists()
    assert not (extensions / build / "lock").exists()


def test_builds_are_named_for_the_torch_install():
    """Another torch install (version, ABI, include folders, Python) builds in a folder of its own."""
    name = build_name("weft_k", "avx2")
    assert name == f"weft_k_avx2_{install_tag()}" and len(install_tag()) == 8
    assert tag_of(["2.13.0", "1", "3.11", "/venv-a/include"]) != tag_of(
        ["2.13.0", "1", "3.11", "/venv-b/include"]
    )


def test_without_torch_extensions_dir_the_lock_is_looked_for_where_torch_builds(
    tmp_path, monkeypatch, caplog
):
    """torch puts its builds under the default root's py311_cpu folder; a stale lock there is found."""
    from torch.utils import cpp_extension

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setattr(cpp_extension, "get_default_build_root", lambda: str(tmp_path))
    folder = build_folder("weft_k_avx2")
    assert str(folder) == cpp_extension._get_build_directory("weft_k_avx2", False)
    (folder / "lock").touch()
    with build_lock("weft_k_avx2"):
        assert not (folder / "lock").exists()
    assert "left by a process stopped while it built weft_k_avx2" in caplog.text


def test_a_library_of_several_files_rebuilds_when_a_header_they_share_changes(tmp_path):
    """A kernel of several source files (the CPU attention's decode and prefill files over their
    shared headers) builds into one library from the files' copies, the headers copied beside them;
    a changed header rebuilds the files that include it, though no source file's text changed."""
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "value.h").write_text("constexpr int kValue = 1;\n")
    (src / "a.cpp").write_text('#include "value.h"\nextern "C" int weft_probe_a() { return kValue; }\n')
    (src / "b.cpp").write_text('#include "value.h"\nextern "C" int weft_probe_b() { return 10 * kValue; }\n')
    extensions = tmp_path / "extensions"
    build = build_name("weft_probe2", "plain")
    code = (
        "import ctypes; from pathlib import Path; from kernels.cpu_build import build; "
        f"src = Path({str(src)!r}); "
        "build('weft_probe2', [src / 'a.cpp', src / 'b.cpp'], 'the probe', isa=('plain', [])); "
        f"lib = ctypes.CDLL({str(extensions / build / f'{build}.so')!r}); "
        "print(lib.weft_probe_a(), lib.weft_probe_b())"
    )
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions), "PYTHONPATH": str(REPO)}

    def built() -> list[str]:
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, timeout=300, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    assert built() == ["1", "10"]
    assert sorted(p.name for p in (extensions / "sources" / build).iterdir()) == ["a.cpp", "b.cpp", "value.h"]
    (src / "value.h").write_text("constexpr int kValue = 2;\n")
    assert built() == ["2", "20"]


def test_the_package_ships_every_kernel_source_and_header():
    """A wheel's kernels are built on first use: each file under kernels/csrc, headers included,
    must match the package data pyproject.toml ships."""
    import fnmatch
    import tomllib

    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "kernels"
    ]
    files = [p.relative_to(REPO / "kernels").as_posix() for p in (REPO / "kernels" / "csrc").iterdir()]
    assert [f for f in files if not any(fnmatch.fnmatch(f, g) for g in globs)] == []
