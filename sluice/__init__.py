"""sluice: an LLM inference engine for concurrent agent workflows."""
from sluice.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":  # lazy: importing sluice should not import torch models
        from sluice.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "__version__"]
