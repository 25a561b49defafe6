"""Which CPU kernel set a machine builds, and the AVX2 set tested on machines that default to another.

The kernel tests (test_kernels_cpu.py, test_attention_cpu.py, test_compiled_stack.py) run the set
`kernel_isa()` picks for this CPU: AVX-512 BF16 where the CPU has it, else AVX2 + FMA. So that the
AVX2 set is tested on an AVX-512 machine too, the last test here runs those tests again in a
subprocess with `SLUICE_CPU_ISA=avx2`. On a CPU with AMX tiles, whose bf16 products run on AMX by
default, they run once more with `SLUICE_CPU_AMX=0`, so that the AVX-512 `vdpbf16ps` paths are
tested there as well.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.attention.cpu import extension

AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx2", "fma"}
AVX2 = {"avx2", "fma", "f16c"}


@pytest.mark.parametrize("flags, env, want", [
    (AVX512, None, "avx512_bf16"),
    (AVX2, None, "avx2"),
    ({"sse4_2", "avx"}, None, None),
    (AVX512 - {"avx512_bf16"}, None, "avx2"),          # AVX-512 without BF16: the AVX2 set
    (AVX512, "avx2", "avx2"),                          # forced onto the AVX2 set
    (AVX2, "avx512_bf16", None),                       # forced onto a set the CPU cannot run
])
def test_kernel_isa_follows_the_cpu_flags(monkeypatch, flags, env, want):
    monkeypatch.setattr(extension, "cpu_flags", lambda: set(flags))
    if env is None:
        monkeypatch.delenv("SLUICE_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("SLUICE_CPU_ISA", env)
    assert extension.kernel_isa() == want
    assert (extension.missing_cpu_flags() == []) == (want is not None)


def test_an_unknown_kernel_set_is_refused(monkeypatch):
    monkeypatch.setattr(extension, "cpu_flags", lambda: set(AVX512))
    monkeypatch.setenv("SLUICE_CPU_ISA", "avx1024")
    with pytest.raises(extension.CpuAttentionUnavailable, match="avx1024"):
        extension.kernel_isa()


def test_every_kernel_set_lists_sources_that_exist():
    here = Path(extension.__file__).parent
    for needs, sources in extension.KERNEL_SETS.values():
        assert needs and all((here / s).is_file() for s in sources)
        assert "stack.cpp" in sources and "ops.cpp" in sources


@pytest.mark.skipif(not {"avx2", "fma"} <= extension.cpu_flags(), reason="CPU lacks AVX2/FMA")
@pytest.mark.skipif(os.environ.get("SLUICE_CPU_ISA", "") == "avx2" or extension.kernel_isa() == "avx2",
                    reason="this process already runs the AVX2 set: the kernel tests cover it")
def test_avx2_kernels_pass_the_kernel_tests():
    _kernel_tests_pass({"SLUICE_CPU_ISA": "avx2"})


@pytest.mark.skipif(not ({"amx_tile", "amx_bf16"} <= extension.cpu_flags() and extension.kernel_isa() == "avx512_bf16"),
                    reason="no AMX here: the kernel tests already run the vector paths")
@pytest.mark.skipif(os.environ.get("SLUICE_CPU_AMX", "") == "0", reason="this process already runs without AMX")
def test_the_avx512_paths_pass_the_kernel_tests_with_amx_off():
    _kernel_tests_pass({"SLUICE_CPU_AMX": "0"})


def _kernel_tests_pass(extra_env: dict[str, str]) -> None:
    tests = Path(__file__).parent
    env = {**os.environ, **extra_env}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         str(tests / "test_kernels_cpu.py"), str(tests / "test_attention_cpu.py"), str(tests / "test_compiled_stack.py")],
        cwd=tests.parent, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout, proc.stdout[-2000:]  # not all skipped
