"""Compiling, loading and checking the paged-attention extension (paged_attention.cpp).

The kernels come in two sets with the same ops: for CPUs with AVX-512 BF16 (paged_attention.cpp,
linear.cpp, fused.cpp: `vdpbf16ps`) and for CPUs with only AVX2 + FMA (the `_avx2.cpp` files:
bfloat16 widened to float32 in registers). `kernel_isa()` picks the set this CPU runs best;
`SLUICE_CPU_ISA=avx2` forces the AVX2 set on an AVX-512 machine (to test or compare it). Within
the AVX-512 set, the linears run on AMX tiles where the CPU has AMX-BF16 (`linear_isa()`;
`SLUICE_CPU_AMX=0` keeps them on `vdpbf16ps`).

The extension is compiled once per (source, CPU flags, kernel set, torch version) with
`torch.utils.cpp_extension.load` into ~/.cache/sluice/torch_extensions and loaded as
`torch.ops.sluice.paged_attention`. Before first use it is compared with the torch reference on a
small mixed batch. Any failure (neither instruction set, no compiler, a wrong result) raises
`CpuAttentionUnavailable` with the reason, and is remembered, so a process tries at most once.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.cpp")
# Per kernel set: the CPU flags it needs, its sources (stack.cpp and ops.cpp go with either set).
KERNEL_SETS = {
    "avx512_bf16": (("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
                    ("paged_attention.cpp", "linear.cpp", "fused.cpp", "stack.cpp", "ops.cpp")),
    "avx2": (("avx2", "fma"), ("paged_attention_avx2.cpp", "linear_avx2.cpp", "fused_avx2.cpp", "stack.cpp", "ops.cpp")),
}
BUILD_ROOT = Path.home() / ".cache" / "sluice" / "torch_extensions"
REQUIRED_CPU_FLAGS = KERNEL_SETS["avx2"][0]  # the least any kernel set needs
CFLAGS = ["-O3", "-march=native", "-std=c++20", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
STALE_LOCK_S = 600  # a build takes well under a minute; an older lock is a killed build's


class CpuAttentionUnavailable(RuntimeError):
    """The compiled CPU backend cannot be used on this machine; the message says why."""


_lock = threading.Lock()
_state: dict[str, object] = {}   # "ok": True once loaded and checked, or "error": the exception


def cpu_flags() -> set[str]:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def missing_cpu_flags() -> list[str]:
    """The CPU features the kernels need that this machine lacks (empty: a kernel set runs here)."""
    if kernel_isa() is not None:
        return []
    wanted = os.environ.get("SLUICE_CPU_ISA", "").strip()
    needs = KERNEL_SETS[wanted][0] if wanted in KERNEL_SETS else REQUIRED_CPU_FLAGS
    flags = cpu_flags()
    return [f for f in needs if f not in flags]


def kernel_isa() -> str | None:
    """The kernel set for this CPU: "avx512_bf16" where it has AVX-512 BF16, else "avx2" where it
    has AVX2 and FMA (or as `SLUICE_CPU_ISA` asks, if the CPU has it), else None."""
    flags = cpu_flags()
    usable = [name for name, (needs, _) in KERNEL_SETS.items() if all(f in flags for f in needs)]
    wanted = os.environ.get("SLUICE_CPU_ISA", "").strip()
    if wanted:
        if wanted not in KERNEL_SETS:
            raise CpuAttentionUnavailable(f"SLUICE_CPU_ISA={wanted!r}: choose one of {sorted(KERNEL_SETS)}")
        return wanted if wanted in usable else None
    return usable[0] if usable else None


def _extension_name(flags: set[str], isa: str) -> str:
    # -march=native code must never be loaded on another CPU from a shared cache.
    # torch rebuilds when a listed source changes, but not when a header does: hash them all.
    code = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(SOURCE.parent.glob("*.[ch]*")))).hexdigest()
    key = "|".join([torch.__version__, " ".join(CFLAGS), " ".join(sorted(flags)), isa, code])
    return "sluice_paged_attention_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def _compile() -> float:
    """Build (or reuse the cached build of) the extension and load it; returns seconds spent."""
    from torch.utils.cpp_extension import load

    isa = kernel_isa()
    if isa is None:
        raise CpuAttentionUnavailable(
            f"CPU lacks {', '.join(missing_cpu_flags()) or os.environ.get('SLUICE_CPU_ISA')} "
            "(need AVX2 and FMA, or AVX-512 F/BW/VL/BF16, on x86-64 Linux)")
    sources = [SOURCE.parent / n for n in KERNEL_SETS[isa][1]]
    name = _extension_name(cpu_flags(), isa)
    build_dir = BUILD_ROOT / name
    build_dir.mkdir(parents=True, exist_ok=True)
    # torch's build lock waits forever on a file left behind by a killed build.
    lock = build_dir / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            logger.warning("removing stale extension build lock %s", lock)
            lock.unlink(missing_ok=True)
    except FileNotFoundError:
        pass
    logger.info("loading the cpu attention extension (%s kernels) from %s (a first build takes ~30 s)", isa, build_dir)
    t0 = time.perf_counter()
    try:
        load(name=name, sources=[str(p) for p in sources], extra_cflags=CFLAGS, extra_ldflags=LDFLAGS,
             build_directory=str(build_dir), is_python_module=False, verbose=False)
    except Exception as e:  # compiler missing, compile error, ninja missing, load failure
        raise CpuAttentionUnavailable(f"compiling {', '.join(p.name for p in sources)} failed: {str(e)[-800:]}") from e
    _state["isa"] = isa
    return time.perf_counter() - t0


def self_check() -> None:
    """Compare the kernel with the torch reference on a tiny batch (2 decodes, 1 chunk after a
    prefix; GQA 3; both dtypes), outputs and cache contents."""
    from sluice.attention.base import AttentionMetadata
    from sluice.attention.torch_ref import TorchPagedAttention

    g = torch.Generator().manual_seed(0)
    block_size, num_blocks, kv_heads, heads, dim = 16, 12, 2, 6, 64
    context, qlens = [20, 33, 17], [1, 1, 9]
    seq_lens = [c + n for c, n in zip(context, qlens)]
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(3, 4, dtype=torch.int32)
    slots, used = [], 0
    for i, n in enumerate(seq_lens):
        nb = -(-n // block_size)
        tables[i, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
        pos = torch.arange(context[i], n)
        slots.append(tables[i, pos // block_size].to(torch.int64) * block_size + pos % block_size)
    qsl = torch.tensor([0, 1, 2, 11], dtype=torch.int32)
    meta = AttentionMetadata(slot_mapping=torch.cat(slots), query_start_loc=qsl,
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
                             num_decodes=2, max_query_len=9, max_seq_len=max(seq_lens),
                             query_lens_list=qlens, seq_lens_list=seq_lens)
    t = sum(qlens)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        cache = [torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(dtype) for _ in range(2)]
        q, k, v = (torch.randn(t, h, dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
        ref_cache = [c.clone() for c in cache]
        want = TorchPagedAttention().forward(q, k, v, *ref_cache, meta, dim ** -0.5)
        got = torch.ops.sluice.paged_attention(q, k, v, *cache, meta.slot_mapping, meta.query_start_loc,
                                               meta.seq_lens, meta.block_tables, dim ** -0.5)
        err = (got.float() - want.float()).abs().max().item()
        if not err <= tol or not all(torch.equal(a, b) for a, b in zip(cache, ref_cache)):
            raise CpuAttentionUnavailable(f"self-check against the torch reference failed ({dtype}: max error {err:.3g})")


def load_extension() -> None:
    """Make `torch.ops.sluice.paged_attention` available, or raise CpuAttentionUnavailable."""
    with _lock:
        if "ok" in _state:
            return
        if "error" in _state:
            raise _state["error"]  # type: ignore[misc]
        try:
            seconds = _compile()
            self_check()
        except CpuAttentionUnavailable as e:
            _state["error"] = e
            raise
        except Exception as e:  # never let a broken build take the engine down
            _state["error"] = CpuAttentionUnavailable(f"loading the extension failed: {e!r}")
            raise _state["error"] from e  # type: ignore[misc]
        _state["ok"] = True
        logger.info("cpu attention extension ready (%s kernels, linears on %s, build/load %.1f s)", _state.get("isa"),
                    linear_isa(), seconds)


def linear_isa() -> str | None:
    """What the packed linears run on: "amx_bf16" (AMX tiles, on CPUs that have them, unless
    `SLUICE_CPU_AMX=0`), else the kernel set's ISA; None before the extension is loaded."""
    if "ok" not in _state:
        return None
    return "amx_bf16" if torch.ops.sluice.linear_amx_enabled() else str(_state.get("isa"))


def is_available() -> bool:
    """True if the extension loads and passes its self-check; logs a warning (once) if not."""
    try:
        load_extension()
        return True
    except CpuAttentionUnavailable as e:
        if not _state.get("warned"):
            _state["warned"] = True
            logger.warning("cpu attention backend unavailable, using the torch backend: %s", e)
        return False
