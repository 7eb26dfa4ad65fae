"""CTranslate2's int8 products: MKL on an x86 CPU without VNNI (oneDNN's saturate there), unless the user chose."""

from __future__ import annotations

from rlt2t.common.ct2_cpu import cpu_flags, prefer_accurate_int8

AVX2 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t: x\n"
VNNI = "flags\t\t: fpu sse2 avx avx2 avx512f avx512_vnni\n"


def test_the_first_flags_line_is_read():
    assert cpu_flags(AVX2) == {"fpu", "sse2", "avx", "avx2", "fma"}
    assert cpu_flags("Processor\t: ARMv8\nFeatures\t: neon\n") == set()


def test_mkl_only_on_x86_without_vnni_and_never_over_the_users_choice():
    env: dict[str, str] = {}
    assert prefer_accurate_int8(env, AVX2) and env == {"CT2_USE_MKL": "1"}
    for cpuinfo in (VNNI, "Features\t: neon\n", ""):  # VNNI: oneDNN is exact enough; not x86: leave it
        env = {}
        assert not prefer_accurate_int8(env, cpuinfo) and env == {}
    env = {"CT2_USE_MKL": "0"}
    assert not prefer_accurate_int8(env, AVX2) and env == {"CT2_USE_MKL": "0"}

