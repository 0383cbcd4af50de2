"""kernels/cpu_int8_gemm.py: one loader for weft's three integer GEMMs (AMX, AVX-512 VNNI, AVX2), a row
of its table each, their switches declared in services/env.py. (The GEMMs' arithmetic is checked in
test_cpu_amx_int8.py, test_cpu_vnni_int8.py and test_cpu_avx2_int8.py.)"""

from __future__ import annotations

import pytest

from kernels import cpu_amx_int8, cpu_avx2_int8, cpu_int8_gemm, cpu_vnni_int8
from services import env

MODULES = {"amx": cpu_amx_int8, "vnni": cpu_vnni_int8, "avx2": cpu_avx2_int8}


def test_each_gemm_module_is_a_row_of_the_table():
    assert set(cpu_int8_gemm.GEMMS) == set(MODULES)
    for isa, module in MODULES.items():
        gemm = cpu_int8_gemm.GEMMS[isa]
        assert module.GEMM == isa and module.ENV_SWITCH == gemm.switch
        env.get_raw(gemm.switch)  # declared (an undeclared name is a KeyError)
        assert f"TORCH_LIBRARY({gemm.namespace}, m)" in (cpu_int8_gemm.CSRC / gemm.source).read_text()


def test_a_switch_at_0_keeps_its_gemm_off_without_building_it(monkeypatch):
    def no_build(*args):
        raise AssertionError("built though its switch is 0")

    monkeypatch.setattr(cpu_int8_gemm, "build_for_flags", no_build)
    for gemm in cpu_int8_gemm.GEMMS.values():
        monkeypatch.setenv(gemm.switch, "0")
    cpu_int8_gemm.available.cache_clear()
    try:
        assert not any(cpu_int8_gemm.available(isa) for isa in cpu_int8_gemm.GEMMS)
    finally:
        cpu_int8_gemm.available.cache_clear()


@pytest.mark.parametrize("isa", sorted(MODULES))
def test_a_bad_switch_is_refused_by_name(monkeypatch, isa):
    gemm = cpu_int8_gemm.GEMMS[isa]
    monkeypatch.setenv(gemm.switch, "")
    with pytest.raises(ValueError, match=f"{gemm.switch} must be 0 or 1"):
        cpu_int8_gemm.enabled_by_env(isa)
