"""Architecture name (config.json `architectures[0]`) -> model class factory."""
from __future__ import annotations

import importlib
from typing import Callable, Optional

from torch import nn

from sluice.attention.base import AttentionBackend
from sluice.config import ModelConfig
from sluice.model.cache_spec import ModelCacheSpec

ModelFactory = Callable[[ModelConfig, AttentionBackend], nn.Module]
_REGISTRY: dict[str, ModelFactory] = {}


def register_model(*architectures: str):
    def deco(factory: ModelFactory) -> ModelFactory:
        for a in architectures:
            _REGISTRY[a] = factory
        return factory
    return deco


def _lazy(module: str, cls: str) -> ModelFactory:
    """A factory that imports the architecture's module only when a model of it is built."""
    def factory(cfg: ModelConfig, backend: AttentionBackend) -> nn.Module:
        return getattr(importlib.import_module(module), cls)(cfg, backend)
    return factory


for _module, _cls, _archs in [
    ("sluice.model.llama", "LlamaForCausalLM", ("LlamaForCausalLM", "MistralForCausalLM")),
    ("sluice.model.qwen", "Qwen2ForCausalLM", ("Qwen2ForCausalLM",)),
    ("sluice.model.qwen", "Qwen3ForCausalLM", ("Qwen3ForCausalLM",)),
    ("sluice.model.qwen", "Qwen3MoeForCausalLM", ("Qwen3MoeForCausalLM",)),
    ("sluice.model.mixtral", "MixtralForCausalLM", ("MixtralForCausalLM",)),
    ("sluice.model.glm4_moe", "Glm4MoeForCausalLM", ("Glm4MoeForCausalLM",)),
    ("sluice.model.glm5_next", "Glm5NextForCausalLM", ("Glm5NextForConditionalGeneration",)),
]:
    register_model(*_archs)(_lazy(_module, _cls))

# Architectures whose layers keep different caches (see cache_spec.py): module, spec function.
# Every other architecture gets the runner's default per-layer K/V tensors.
_CACHE_SPECS: dict[str, tuple[str, str]] = {
    "Glm5NextForConditionalGeneration": ("sluice.model.glm5_next", "cache_spec"),
}


def model_cache_spec(cfg: ModelConfig) -> Optional[ModelCacheSpec]:
    entry = _CACHE_SPECS.get(cfg.architecture)
    if entry is None:
        return None
    return getattr(importlib.import_module(entry[0]), entry[1])(cfg)


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
