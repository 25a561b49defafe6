"""transformers' own load of a GGUF file, the reference several test modules compare against.

transformers dequantizes a GGUF in Python: ~20 s for SmolLM2's model and ~8 s for its tokenizer on
these machines. Each is loaded once per test session and shared; callers must not modify what they
get (deep-copy the model before casting it, as test_model_smollm2's bfloat16 test does)."""
from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def _model_fp32(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    p = Path(path)
    return AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32).eval()


@functools.cache
def _tokenizer(path: str):
    from transformers import AutoTokenizer

    p = Path(path)
    return AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)


def hf_model_fp32(gguf_path: str | Path):
    """transformers' float32 model from the GGUF file (shared: do not modify)."""
    return _model_fp32(str(Path(gguf_path).resolve()))


def hf_tokenizer(gguf_path: str | Path):
    """transformers' tokenizer (with the chat template) from the GGUF file (shared: do not modify)."""
    return _tokenizer(str(Path(gguf_path).resolve()))
