"""Attention backends behind one interface (see base.py), chosen by name."""
from __future__ import annotations

from typing import Callable

from sluice.attention.base import AttentionBackend, AttentionMetadata

_REGISTRY: dict[str, Callable[[], AttentionBackend]] = {}


def register_backend(name: str, factory: Callable[[], AttentionBackend]) -> None:
    _REGISTRY[name] = factory


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def create_backend(name: str = "auto") -> AttentionBackend:
    """`auto` is the compiled "cpu" backend when it builds and passes its self-check on this
    machine, else "torch" (with a logged warning saying why)."""
    if name == "auto":
        from sluice.attention.cpu.extension import is_available

        name = "cpu" if is_available() else "torch"
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; available: {available_backends()}") from None


def _torch() -> AttentionBackend:
    from sluice.attention.torch_ref import TorchPagedAttention

    return TorchPagedAttention()


def _cpu() -> AttentionBackend:
    from sluice.attention.cpu import CpuPagedAttention

    return CpuPagedAttention()


register_backend("torch", _torch)
register_backend("cpu", _cpu)

__all__ = ["AttentionBackend", "AttentionMetadata", "create_backend", "register_backend", "available_backends"]
