"""Long-lived tensors (weights, KV cache) on transparent huge pages.

A decode step reads every running sequence's K/V: per layer, per 16-token block, a 6 KB run at a
block-table address, scattered over a cache of a gigabyte or more. On 4 KB pages each run spans
two or three pages, and the cache is far larger than the TLB covers, so each run starts with page
walks that the kernel's software prefetch cannot hide. On 2 MB pages one TLB entry covers 340
blocks. Measured on the AVX2 machine type (session 31, `docs/measured/s31/`): one thread reading
random 6 KB runs went from 7.5 to 9.5 GB/s, sequential reading from 13.8 to 17.7 GB/s, one thread
of decode attention 4-9% faster, the engine's decode step at batch 32 and 2k context ~5% faster
(unchanged at 1k context and at batch 1, where the kernel's compute and the blocks' short runs
bound it before page walks do).

Linux gives an anonymous private mapping huge pages where it is 2 MB aligned and advised
`MADV_HUGEPAGE` (the default "madvise" mode of /sys/kernel/mm/transparent_hugepage/enabled, which
torch's allocator does not use unless THP_MEM_ALLOC_ENABLE is set). `HugePageArena` maps one
region, advises it before anything touches it and hands out aligned tensor views of it; where
that is unavailable (another OS, THP "never", a mapping refused) it falls back to ordinary
tensors, so callers need no second path.
"""
from __future__ import annotations

import ctypes
import logging
import math
import mmap
import sys
from pathlib import Path
from typing import Iterable, Optional

import torch
from torch import nn

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_ALIGN = 64  # every view starts on a cache line
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> Optional[str]:
    """The kernel's transparent-huge-page mode ("always", "madvise", "never"), None if unknown."""
    try:
        text = _THP_ENABLED.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def available() -> bool:
    """Whether advised mappings can get huge pages on this machine."""
    return (sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")
            and thp_mode() in ("always", "madvise"))


class HugePageArena:
    """One advised anonymous mapping of at least `nbytes`, carved into tensors by `take`.

    The views keep the mapping alive (torch holds the buffer); the arena object itself may go.
    Memory is zero until written and counted in RSS as it is touched: `take(..., touch=True)`
    faults a view in at once, so that the first steps do not pay for it.
    """

    def __init__(self, nbytes: int) -> None:
        self.size = max(HUGE_PAGE, -(-nbytes // HUGE_PAGE) * HUGE_PAGE)
        self.used = 0
        # One huge page more than needed, so that the views can start on a 2 MB boundary of it.
        self._map = mmap.mmap(-1, self.size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._map.madvise(mmap.MADV_HUGEPAGE)
        raw = torch.frombuffer(self._map, dtype=torch.uint8)
        skew = (-raw.data_ptr()) % HUGE_PAGE
        self._bytes = raw[skew:skew + self.size]

    def take(self, shape: Iterable[int], dtype: torch.dtype, touch: bool = True) -> torch.Tensor:
        shape = tuple(int(s) for s in shape)
        start, nbytes = _align(self.used), math.prod(shape) * dtype.itemsize
        if start + nbytes > self.size:
            raise ValueError(f"the arena has {self.size - start} bytes left, {nbytes} asked")
        self.used = start + nbytes
        view = self._bytes[start:start + nbytes].view(dtype).view(shape)
        if touch:
            view.zero_()
        return view


def _align(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def _footprint(shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> int:
    """Bytes an arena needs for these tensors, laid out as `take` lays them."""
    total = 0
    for shape, dtype in shapes:
        total = _align(total) + math.prod(shape) * dtype.itemsize
    return total


def zeros(shapes: list[tuple[tuple[int, ...], torch.dtype]], huge_pages: bool) -> list[torch.Tensor]:
    """Zero tensors of the given shapes and dtypes, on huge pages when `huge_pages` and the
    machine allows (one arena for all of them), else from torch's allocator."""
    if huge_pages and available() and shapes:
        try:
            arena = HugePageArena(_footprint(shapes))
        except (OSError, ValueError) as e:  # a refused mapping: ordinary tensors do the same job
            logger.warning("huge pages unavailable (%s); allocating normally", e)
        else:
            return [arena.take(shape, dtype) for shape, dtype in shapes]
    return [torch.zeros(shape, dtype=dtype) for shape, dtype in shapes]


def _key(t: torch.Tensor) -> tuple:
    return t.data_ptr(), tuple(t.shape), t.dtype


def move_module(model: nn.Module, min_bytes: int = 1 << 16) -> int:
    """Copy `model`'s parameters and buffers of at least `min_bytes` into one huge-page arena and
    point the modules at the copies (a tensor shared by several modules, such as tied embeddings,
    stays shared). Call before anything keeps references to the old tensors. Returns the bytes
    moved (0 where huge pages are unavailable)."""
    if not available():
        return 0
    slots: list[tuple[nn.Module, str, bool]] = []   # (module, name, is_parameter)
    unique: dict[tuple, torch.Tensor] = {}          # the same memory seen twice is one tensor
    for module in model.modules():
        for table, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, t in table.items():
                if (t is None or t.device.type != "cpu" or not t.is_contiguous()
                        or t.numel() * t.element_size() < min_bytes):
                    continue
                slots.append((module, name, is_param))
                unique.setdefault(_key(t), t)
    if not unique:
        return 0
    tensors = list(unique.values())
    try:
        arena = HugePageArena(_footprint([(tuple(t.shape), t.dtype) for t in tensors]))
    except (OSError, ValueError) as e:
        logger.warning("huge pages unavailable (%s); weights stay where they are", e)
        return 0
    moved: dict[tuple, torch.Tensor] = {}
    for t in tensors:
        copy = arena.take(t.shape, t.dtype, touch=False)
        copy.copy_(t.detach())
        moved[_key(t)] = copy
    replaced: dict[int, nn.Parameter] = {}  # one Parameter per shared tensor, so ties stay ties
    for module, name, is_param in slots:
        old = (module._parameters if is_param else module._buffers)[name]
        new = moved[_key(old)]
        if is_param:
            key = id(old)
            if key not in replaced:
                replaced[key] = nn.Parameter(new, requires_grad=old.requires_grad)
            module._parameters[name] = replaced[key]
        else:
            module._buffers[name] = new
    del tensors, unique, slots, t, old  # the last loop variables too: no old copy may survive the trim
    _return_freed_heap()
    logger.info("weights on transparent huge pages (%.0f MiB)", arena.used / (1 << 20))
    return arena.used


def _return_freed_heap() -> None:
    """Hand the heap memory the moved tensors held back to the OS. glibc keeps freed chunks below
    its mmap threshold (which grows to 32 MB) in the heap, so without this the old copies of the
    weights stay resident: +370 MB of RSS for SmolLM2 (measured, session 31)."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim(0)
