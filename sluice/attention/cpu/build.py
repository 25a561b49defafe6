"""Compile the CPU attention extension ahead of time: `python -m sluice.attention.cpu.build`.

Exits 0 when the extension is built (or already cached) and passes its self-check, 1 otherwise;
the engine then runs on the torch backend, so callers may treat failure as a warning.
"""
from __future__ import annotations

import sys
import time

from sluice.attention.cpu.extension import BUILD_ROOT, CpuAttentionUnavailable, kernel_isa, linear_isa, load_extension


def main() -> int:
    t0 = time.perf_counter()
    try:
        load_extension()
    except CpuAttentionUnavailable as e:
        print(f"sluice: cpu attention backend unavailable ({e}); the engine will use the torch backend",
              file=sys.stderr)
        return 1
    print(f"sluice: cpu attention backend ready ({kernel_isa()} kernels, linears on {linear_isa()}) in {time.perf_counter() - t0:.1f} s "
          f"(cache: {BUILD_ROOT})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
