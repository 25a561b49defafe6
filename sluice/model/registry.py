"""Architecture name (config.json `architectures[0]`) -> model class factory."""
from __future__ import annotations

from typing import Callable

from torch import nn

from sluice.attention.base import AttentionBackend
from sluice.config import ModelConfig

ModelFactory = Callable[[ModelConfig, AttentionBackend], nn.Module]
_REGISTRY: dict[str, ModelFactory] = {}


def register_model(*architectures: str):
    def deco(factory: ModelFactory) -> ModelFactory:
        for a in architectures:
            _REGISTRY[a] = factory
        return factory
    return deco


def _llama(cfg: ModelConfig, backend: AttentionBackend) -> nn.Module:
    from sluice.model.llama import LlamaForCausalLM

    return LlamaForCausalLM(cfg, backend)


register_model("LlamaForCausalLM", "MistralForCausalLM")(_llama)


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def create_model(cfg: ModelConfig, backend: AttentionBackend) -> nn.Module:
    try:
        factory = _REGISTRY[cfg.architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {cfg.architecture!r}; supported: {supported_architectures()}"
        ) from None
    return factory(cfg, backend)
