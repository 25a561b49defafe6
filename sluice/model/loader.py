"""Find a model, read its config, build it and load its weights (HF folder or GGUF file)."""
from __future__ import annotations

import dataclasses
import json
import logging
from collections import Counter
from pathlib import Path
from typing import Iterator, Optional

import torch
from safetensors import safe_open
from torch import nn

from sluice import hugepages
from sluice.attention.base import AttentionBackend
from sluice.config import ModelConfig, check_weight_format
from sluice.model.registry import create_model
from sluice.tokenizer import Tokenizer, hf_folder_info

logger = logging.getLogger(__name__)


def resolve_model_path(model: Optional[str]) -> Path:
    if model is None:
        from sluice.model.default import ensure_default_model

        return ensure_default_model()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {model!r} does not exist (sluice never downloads from a model hub)")
    return path


def _is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def model_config_from_hf(cfg: dict) -> ModelConfig:
    """Build a ModelConfig from a config.json dict (transformers 4 and 5 spellings)."""
    text = cfg.get("text_config")
    if isinstance(text, dict):  # a multimodal checkpoint (GLM-5.3): sluice serves its text model
        cfg = {**{k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}, **text,
               "architectures": cfg.get("architectures")}
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}.get(
        cfg.get("model_type", ""), "")
    rope_params = cfg.get("rope_parameters") or {}
    rope_theta = rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_scaling = cfg.get("rope_scaling")
    if rope_params and rope_params.get("rope_type", "default") != "default":
        rope_scaling = rope_params
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
        rope_scaling = None
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    eos = cfg.get("eos_token_id")
    eos_ids = tuple([eos] if isinstance(eos, int) else (eos or []))
    return ModelConfig(
        architecture=arch,
        model_type=cfg.get("model_type", ""),
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=cfg.get("attention_bias", False),
        mlp_bias=cfg.get("mlp_bias", False),
        rope_scaling=rope_scaling,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        extra=cfg,
    )


def load_model_config(path: Path) -> ModelConfig:
    if _is_gguf(path):
        from sluice.model.gguf_loader import read_gguf

        return model_config_from_hf(read_gguf(path).hf_config)
    return model_config_from_hf(json.loads((path / "config.json").read_text()))


def load_tokenizer(path: Path, chat_template: Optional[str] = None) -> Tokenizer:
    """The model's tokenizer; `chat_template` (a template's text) replaces the model's own."""
    if _is_gguf(path):
        from sluice.model.gguf_loader import read_gguf

        info = read_gguf(path).tokenizer
    else:
        info = hf_folder_info(path)
    if chat_template is not None:
        info = dataclasses.replace(info, chat_template=chat_template)
    return Tokenizer(info)


def _iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                yield name, sf.get_tensor(name)


def load_model(path: Path, cfg: ModelConfig, dtype: torch.dtype, backend: AttentionBackend,
               huge_pages: bool = False, weight_format: str = "auto") -> nn.Module:
    """Build the model in `dtype` and stream the checkpoint into it, one tensor at a time; with
    `huge_pages`, the weights end on transparent huge pages (sluice/hugepages.py). With
    `weight_format` "native", the packed linears of a GGUF file's Q4_1 and Q8_0 tensors keep its
    blocks (where the CPU kernels compute from them: the same bf16 weights, read from a third to a
    half of the memory); "bf16" dequantizes every weight at load; "auto" is one of the two by the
    linears' path (`keeps_blocks`)."""
    check_weight_format(weight_format)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = create_model(cfg, backend)
    finally:
        torch.set_default_dtype(prev)
    model = model.to_empty(device="cpu")
    _rebuild_buffers(model, cfg)  # rotary tables are not in the checkpoint
    if _is_gguf(path):
        from sluice.model.gguf_loader import read_gguf

        weights = read_gguf(path).iter_tensors(torch.float32)
    else:
        weights = _iter_safetensors(path)
    model.load_weights(weights)
    if cfg.tie_word_embeddings and hasattr(model, "lm_head"):
        model.lm_head.weight = model.embed_tokens.weight
    if dtype == torch.bfloat16 and getattr(backend, "name", None) == "cpu":
        from sluice.model.packed_linear import PackedLinear, use_cpu_kernels

        gguf = _is_gguf(path)
        if gguf and torch.ops.sluice.linear_blocks_supported() and \
                keeps_blocks(weight_format, torch.ops.sluice.linear_amx_enabled()):
            _attach_blocks(model, read_gguf(path))

        use_cpu_kernels(model, huge_pages)  # the cpu backend's extension also holds linear, norm and rotary kernels
        if gguf:
            kinds = Counter(m.format for m in model.modules() if isinstance(m, PackedLinear))
            logger.info("weight format %s: packed linears %s", weight_format,
                        ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())))
    elif huge_pages:
        hugepages.move_module(model)
    return model.eval()


def keeps_blocks(weight_format: str, amx: bool) -> bool:
    """Whether the linears keep a GGUF's blocks (where the kernels can compute from them).

    "auto" keeps them where the linears run on AMX tiles: there a step's products are cheap beside
    streaming the weights, and the blocks' third of the bytes made sustained serving 5.8% faster
    (docs/benchmarks.md, session 49). On the AVX-512 vector path (Zen 4) the products themselves
    bound a loaded step, and the dequantization is vector work on top of them: sustained serving
    ran 4.6% slower from the blocks at a fixed bound (session 52), so "auto" dequantizes at load
    there. Only a lone decode (one row) can be faster from the blocks on that path (0-20% in the
    linears)."""
    check_weight_format(weight_format)
    return weight_format == "native" or (weight_format == "auto" and amx)


def _attach_blocks(model: nn.Module, ckpt) -> None:
    """Give each linear whose every weight row is a Q4_1 or Q8_0 tensor's (or, fused, several
    tensors' of one kind) those rows' blocks, as `gguf_blocks` = (kind, [out, in / 32, bytes] uint8,
    rows in the weight's order), for `pack_linear_layers`. A tied LM head gets the embedding's."""
    params = dict(model.named_parameters(remove_duplicate=False))
    parts: dict[str, list[tuple[tuple, str, torch.Tensor]]] = {}
    for name, kind, blocks in ckpt.iter_blocks():
        target = model._target(name, params)
        if target is None:
            continue
        pname, index = target
        parts.setdefault(pname, []).append((index, kind, blocks))
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(model, "embed_tokens", None)
    for pname, pieces in parts.items():
        module_name, _, leaf = pname.rpartition(".")
        module = model.get_submodule(module_name)
        if embed is not None and module is embed and lm_head is not None and lm_head.weight is embed.weight:
            module = lm_head   # tied: the LM head is the linear that reads these blocks
        weight = params[pname]
        kinds = {kind for _, kind, _ in pieces}
        if leaf != "weight" or type(module) is not nn.Linear or weight.dim() != 2 or weight.shape[1] % 32 \
                or len(kinds) != 1:
            continue
        (kind,) = kinds
        full = torch.empty(weight.shape[0], weight.shape[1] // 32, pieces[0][2].shape[2], dtype=torch.uint8)
        covered = torch.zeros(weight.shape[0], dtype=torch.bool)
        for index, _, blocks in pieces:
            if len(index) > 1 or (index and not isinstance(index[0], slice)):
                break   # experts: not a plain linear
            rows = index[0] if index else slice(0, weight.shape[0])
            full[rows] = blocks
            covered[rows] = True
        else:
            if bool(covered.all()):
                module.gguf_blocks = (kind, full)


def _rebuild_buffers(model: nn.Module, cfg: ModelConfig) -> None:
    from sluice.model.layers import RotaryEmbedding

    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            fresh = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                    cfg.rope_scaling, module.rotary_dim)
            module.cos = fresh.cos
            module.sin = fresh.sin
