"""kernels/cpu_build.py: the source a CPU kernel is built from sits at a path of the build's own,
so checkouts in different folders share one build instead of rebuilding each other's."""

from __future__ import annotations

import os

from kernels.cpu_build import stable_source


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
