"""Llama-family GGUF files: HF-style config, tokenizer and dequantized weights; export to an HF folder.

A GGUF carries no config.json or tokenizer.json: its metadata (llama.cpp key names) is both. We
rebuild the transformers config dict and a `tokenizers` JSON from it, and stream the weights out
under HF names, one tensor at a time, dequantized with `gguf.quants`.

Two details llama.cpp's converter leaves in the file that must be undone or reproduced:
- q_proj/k_proj rows are permuted per head for llama.cpp's interleaved rotary layout
  (see `_unpermute_rotary`).
- The pre-tokenizer is named, not stored (`tokenizer.ggml.pre`); each name stands for a fixed
  sequence of split regexes in llama.cpp (see `_PRE_TOKENIZERS`).
"""
from __future__ import annotations

import copy
import functools
import json
import os
import re
import shutil
import struct
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch
from gguf import GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize, quant_shape_to_byte_shape

from sluice.tokenizer import TokenizerInfo

_SUPPORTED_ARCHITECTURES = ("llama",)  # Mistral and SmolLM files say "llama" too

# llama.cpp's `llama_token_type` values (tokenizer.ggml.token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSOR_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


# --------------------------------------------------------------------------------------------
# File structure. gguf's GGUFReader builds a numpy view per array element, which takes seconds
# on a 49k-token vocabulary; this reads the same layout (GGUF v2/v3, little-endian) directly.
# --------------------------------------------------------------------------------------------

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    dims: tuple[int, ...]           # numpy order (outermost first); ggml lists them innermost first
    qtype: GGMLQuantizationType
    offset: int                     # absolute byte offset in the file


class _GGUFFile:
    """Metadata and tensor infos of a GGUF file; tensor data stays in a read-only memory map."""

    def __init__(self, path: Path) -> None:
        self._buf = np.memmap(path, dtype=np.uint8, mode="r")
        self._view = memoryview(self._buf)  # slicing the memmap itself costs ~3 us a string (98k here)
        if bytes(self._buf[:4]) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        self._pos = 4
        version = self._scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3, little-endian)")
        n_tensors, n_kv = self._scalar("<Q"), self._scalar("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(GGUFValueType(self._scalar("<I")))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._scalar("<I")
            ggml_dims = [self._scalar("<Q") for _ in range(n_dims)]
            qtype = GGMLQuantizationType(self._scalar("<I"))
            infos.append((name, tuple(reversed(ggml_dims)), qtype, self._scalar("<Q")))
        alignment = self.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        data_start = -(-self._pos // alignment) * alignment
        self.tensors = {name: _TensorInfo(name, dims, qtype, data_start + off) for name, dims, qtype, off in infos}

    def _scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._view, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._scalar("<Q")
        value = str(self._view[self._pos:self._pos + n], "utf-8")
        self._pos += n
        return value

    def _value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self._string()
        if vtype == GGUFValueType.ARRAY:
            item_type = GGUFValueType(self._scalar("<I"))
            count = self._scalar("<Q")
            if item_type in (GGUFValueType.STRING, GGUFValueType.ARRAY):
                return [self._value(item_type) for _ in range(count)]
            fmt = _SCALAR_FORMATS[item_type]
            items = np.frombuffer(self._buf, dtype=np.dtype(fmt), count=count, offset=self._pos)
            self._pos += items.nbytes
            return items.tolist()
        return self._scalar(_SCALAR_FORMATS[vtype])

    def raw(self, info: _TensorInfo) -> np.ndarray:
        """The tensor's stored data: float arrays for F32/F16, else bytes shaped [..., row_bytes]."""
        if info.qtype == GGMLQuantizationType.F32:
            dtype, shape = np.dtype("<f4"), info.dims
        elif info.qtype == GGMLQuantizationType.F16:
            dtype, shape = np.dtype("<f2"), info.dims
        else:
            dtype, shape = np.dtype(np.uint8), quant_shape_to_byte_shape(info.dims, info.qtype)
        count = int(np.prod(shape))
        return np.frombuffer(self._buf, dtype=dtype, count=count, offset=info.offset).reshape(shape)


# --------------------------------------------------------------------------------------------
# Pre-tokenizers: llama.cpp's regex sequences per `tokenizer.ggml.pre`, as `tokenizers` JSON.
# --------------------------------------------------------------------------------------------

def _byte_level(use_regex: bool) -> dict[str, Any]:
    # With use_regex=True this splits with GPT-2's pattern before mapping bytes to characters.
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


def _split(pattern: str) -> dict[str, Any]:
    return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}


_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _PreTokenizerSpec:
    pre_tokenizer: dict[str, Any]  # `tokenizers` JSON
    ignore_merges: bool = False    # a word that is itself a token is not merged (llama.cpp: Llama 3, Tekken)
    add_bos: bool = False          # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token


_GPT2 = _PreTokenizerSpec({"type": "Sequence", "pretokenizers": [_byte_level(True)]})
# "\p{N}" isolated, then GPT-2's pattern: the Digits + ByteLevel pair of the original tokenizer.json.
_DIGITS_THEN_GPT2 = _PreTokenizerSpec(
    {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _byte_level(True)]}
)
_LLAMA3_REGEX = {"type": "Sequence", "pretokenizers": [_split(_LLAMA3_SPLIT), _byte_level(False)]}
_LLAMA3 = _PreTokenizerSpec(_LLAMA3_REGEX, ignore_merges=True, add_bos=True)
_TEKKEN = _PreTokenizerSpec(
    {"type": "Sequence", "pretokenizers": [_split(_TEKKEN_SPLIT), _byte_level(False)]},
    ignore_merges=True, add_bos=True,
)

# Names as llama.cpp's llama-vocab.cpp spells them; "default" (a file converted before the key
# existed) is left out on purpose: llama.cpp itself warns that it degrades generation.
_PRE_TOKENIZERS: dict[str, _PreTokenizerSpec] = {
    **dict.fromkeys(["gpt-2", "mpt", "olmo", "jais"], _GPT2),
    **dict.fromkeys(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"],
                    _DIGITS_THEN_GPT2),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0"], _LLAMA3),
    **dict.fromkeys(["dbrx", "smaug-bpe"], _PreTokenizerSpec(_LLAMA3_REGEX)),
    "tekken": _TEKKEN,
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_SPECIAL_TOKEN_KEYS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                       "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def _special_tokens(meta: dict[str, Any]) -> dict[str, str]:
    """`bos_token`/`eos_token`/`unk_token`/`pad_token` -> token text, for those the file names."""
    tokens = meta["tokenizer.ggml.tokens"]
    found = {}
    for name, key in _SPECIAL_TOKEN_KEYS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= token_id < len(tokens):
            found[name] = tokens[token_id]
    return found


def _build_tokenizer(meta: dict[str, Any]) -> TokenizerInfo:
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {model!r} is not supported; sluice builds byte-level BPE ('gpt2') "
            "vocabularies only (sentencepiece 'llama' vocabularies are not supported yet)"
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    spec = _PRE_TOKENIZERS.get(pre)
    if spec is None:
        raise ValueError(
            f"GGUF pre-tokenizer {pre!r} is not supported; known: {sorted(_PRE_TOKENIZERS)}"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)

    # Normal tokens are already spelled in the byte alphabet; control and user-defined tokens are
    # stored as raw text and must keep that spelling so the added-token entries below map onto
    # their own ids. Anything else outside the alphabet gets respelled byte by byte.
    byte_chars = _bytes_to_unicode()
    alphabet = set(byte_chars.values())
    vocab: dict[str, int] = {}
    added_tokens: list[dict[str, Any]] = []
    for token_id, (token, token_type) in enumerate(zip(tokens, token_types)):
        if token_type in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED):
            added_tokens.append({
                "id": token_id, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
                "normalized": False, "special": token_type == _TOKEN_CONTROL,
            })
        elif not set(token) <= alphabet:
            token = "".join(byte_chars[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, token_id)

    merges = []
    for merge in meta.get("tokenizer.ggml.merges", []):
        pair = merge.split(" ")
        if len(pair) != 2:
            raise ValueError(f"malformed GGUF merge {merge!r}")
        merges.append(pair)

    special = _special_tokens(meta)
    bos = special.get("bos_token")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", spec.add_bos)) and bos is not None
    if add_bos:
        # Baked in so that plain `tokenizers` users get BOS too; sluice's Tokenizer adds it itself.
        bos_id = meta["tokenizer.ggml.bos_token_id"]
        post_processor: dict[str, Any] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                {"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
        }
    else:
        post_processor = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}

    tokenizer_json = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added_tokens,
        "normalizer": None,
        "pre_tokenizer": spec.pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
            "ignore_merges": spec.ignore_merges, "vocab": vocab, "merges": merges,
        },
    }
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    extra_eos = [
        meta[f"tokenizer.ggml.{key}"] for key in ("eot_token_id", "eom_token_id")
        if meta.get(f"tokenizer.ggml.{key}") is not None and meta[f"tokenizer.ggml.{key}"] != eos_id
    ]
    return TokenizerInfo(
        tokenizer_json=json.dumps(tokenizer_json, ensure_ascii=False),
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token=bos,
        eos_token=special.get("eos_token"),
        add_bos_token=add_bos,
        eos_token_ids=tuple(dict.fromkeys(extra_eos)),
    )


# --------------------------------------------------------------------------------------------
# Config and weights.
# --------------------------------------------------------------------------------------------

def _clean_float(value: float) -> float:
    """A float32 metadata value as its shortest round-tripping decimal (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _llama_hf_config(meta: dict[str, Any], tensors: dict[str, _TensorInfo]) -> dict[str, Any]:
    arch = meta["general.architecture"]

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{name}")
        return value

    hidden = key("embedding_length")
    heads = key("attention.head_count")
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(heads, list) or isinstance(kv_heads, list):
        raise ValueError("GGUF files with per-layer head counts are not supported")
    head_dim = key("attention.key_length", hidden // heads)
    if key("rope.dimension_count", head_dim) != head_dim:
        raise ValueError("GGUF files with partial rotary embeddings are not supported for llama")
    if "rope_freqs.weight" in tensors:
        raise ValueError(
            "GGUF file carries per-dimension rope frequency factors (Llama 3.1-style rope scaling); "
            "not supported"
        )
    rope: dict[str, Any] = {"rope_theta": _clean_float(key("rope.freq_base", 10000.0)), "rope_type": "default"}
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        rope.update(rope_type="linear", factor=_clean_float(key("rope.scaling.factor")))
    elif scaling != "none":
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported")

    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF file has no token_embd.weight")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _clean_float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": rope["rope_theta"],
        "rope_parameters": rope,
        "max_position_embeddings": key("context_length"),
        "vocab_size": tensors["token_embd.weight"].dims[0],
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
    }
    for name in ("bos", "eos", "padding"):
        token_id = meta.get(f"tokenizer.ggml.{name}_token_id")
        if token_id is not None:
            config[f"{'pad' if name == 'padding' else name}_token_id"] = token_id
    return config


def _hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    m = _LAYER_TENSOR_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_TENSORS:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Llama counterpart (mixture-of-experts files "
                         "and other variants are not supported)")
    layer, kind, param = m.groups()
    return f"model.layers.{layer}.{_LAYER_TENSORS[kind]}.{param}"


def _unpermute_rotary(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp rotates adjacent pairs (x0, x1), (x2, x3), ... of each head, so its converter
    reorders every head's rows from HF's halves layout [first half | second half] into pairs
    (row i, row i + head_dim/2). Here each head's rows are read back as [head_dim/2, 2] and
    transposed. Works for weights [rows, in] and biases [rows]; k uses the KV head count.
    """
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class _TensorEntry:
    hf_name: str
    info: _TensorInfo
    rotary_heads: Optional[int]  # heads to un-permute over (q_proj, k_proj), else None


@dataclass
class GGUFCheckpoint:
    """A GGUF file opened lazily: config and tokenizer are read up front, weights on demand.

    The file stays memory-mapped while this object lives; `iter_tensors` dequantizes one tensor
    at a time, so at most one full-precision tensor beyond the caller's copy is alive at once.
    """

    path: Path
    hf_config: dict[str, Any]          # transformers-style config.json contents
    tokenizer: TokenizerInfo
    special_tokens: dict[str, str]     # bos_token/eos_token/unk_token/pad_token -> text, where named
    _entries: list[_TensorEntry] = field(repr=False)
    _file: _GGUFFile = field(repr=False)

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name -> shape of every tensor `iter_tensors` yields, in the same order."""
        return {e.hf_name: e.info.dims for e in self._entries}

    def iter_tensors(self, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `(hf_name, tensor)` pairs, dequantized to `dtype` and shaped as transformers expects.

        `lm_head.weight` appears only when the file has an output matrix of its own (untied).
        """
        for entry in self._entries:
            raw = self._file.raw(entry.info)
            w = dequantize(raw, entry.info.qtype).reshape(entry.info.dims)  # float32
            if entry.rotary_heads is not None:
                w = _unpermute_rotary(w, entry.rotary_heads)
            if np.may_share_memory(w, raw):  # F32 tensors are views of the read-only map
                w = w.copy()
            yield entry.hf_name, torch.from_numpy(w).to(dtype)

    # GGUF block types a packed linear can keep (sluice/model/packed_linear.py's BLOCK_FORMATS).
    _BLOCK_TYPES = {GGMLQuantizationType.Q4_1: "q4_1", GGMLQuantizationType.Q8_0: "q8_0"}

    def iter_blocks(self) -> Iterator[tuple[str, str, torch.Tensor]]:
        """Yield `(hf_name, kind, blocks)` for every 2-D Q4_1 ("q4_1") or Q8_0 ("q8_0") tensor: its
        blocks as stored, uint8 [rows, in / 32, block bytes], rows in the order `iter_tensors` gives
        them (q_proj/k_proj un-permuted), so that block [r, b] dequantizes to row r's columns
        [32 b, 32 b + 32) of that tensor."""
        for entry in self._entries:
            if entry.info.qtype not in self._BLOCK_TYPES or len(entry.info.dims) != 2:
                continue
            rows, cols = entry.info.dims
            blocks = self._file.raw(entry.info).reshape(rows, cols // 32, -1)  # [rows, row bytes] -> blocks
            if entry.rotary_heads is not None:
                blocks = _unpermute_rotary(blocks, entry.rotary_heads)
            # np.array: a copy, the map is read-only
            yield entry.hf_name, self._BLOCK_TYPES[entry.info.qtype], torch.from_numpy(np.array(blocks))


def read_gguf(path: str | Path) -> GGUFCheckpoint:
    """Open a Llama-family GGUF file; raises ValueError for other architectures or tokenizers.

    Loading a model reads the file's header three times (config, tokenizer, weights), ~1 s each
    for a 49k-token vocabulary: the parse is kept per file version (path, size, mtime)."""
    path = Path(path)
    st = path.stat()
    ckpt = _read_gguf_cached(str(path.resolve()), st.st_size, st.st_mtime_ns)
    return replace(ckpt, path=path, hf_config=copy.deepcopy(ckpt.hf_config))


@functools.lru_cache(maxsize=4)
def _read_gguf_cached(path_str: str, size: int, mtime_ns: int) -> GGUFCheckpoint:
    del size, mtime_ns  # part of the cache key only
    path = Path(path_str)
    gguf_file = _GGUFFile(path)
    meta = gguf_file.metadata
    arch = meta.get("general.architecture")
    if arch not in _SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; sluice reads {list(_SUPPORTED_ARCHITECTURES)} "
            "(which covers Llama, Mistral and SmolLM files)"
        )
    hf_config = _llama_hf_config(meta, gguf_file.tensors)
    rotary_heads = {"attn_q": hf_config["num_attention_heads"], "attn_k": hf_config["num_key_value_heads"]}
    entries = []
    for name, info in gguf_file.tensors.items():
        kind = name.split(".")[2] if name.startswith("blk.") else None
        entries.append(_TensorEntry(_hf_tensor_name(name), info, rotary_heads.get(kind)))
    tokenizer = _build_tokenizer(meta)
    return GGUFCheckpoint(path, hf_config, tokenizer, _special_tokens(meta), entries, gguf_file)


# --------------------------------------------------------------------------------------------
# HF export.
# --------------------------------------------------------------------------------------------

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _write_safetensors(ckpt: GGUFCheckpoint, dtype: torch.dtype, path: Path) -> None:
    """Stream the checkpoint into one safetensors file without materialising the whole model.

    The header needs every shape and offset first; GGUF tensor infos give them without
    dequantizing, then tensors are written in order as `iter_tensors` produces them.
    """
    shapes = ckpt.tensor_shapes()
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        nbytes = int(np.prod(shape)) * itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for (name, tensor), expected in zip(ckpt.iter_tensors(dtype), shapes.items(), strict=True):
            assert (name, tuple(tensor.shape)) == expected, (name, tensor.shape, expected)
            f.write(tensor.contiguous().view(torch.uint8).numpy().data)


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def export_hf(gguf_path: str | Path, out_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """Write a transformers/vLLM-loadable folder (config, safetensors, tokenizer) from a GGUF file.

    Weights are the GGUF's dequantized values cast to `dtype`; quantization is not preserved.
    The folder is built under a temporary name next to `out_dir` and renamed into place, so a
    failed export leaves nothing behind; an existing non-empty `out_dir` is an error.
    """
    if dtype not in _EXPORT_DTYPES:
        raise ValueError(f"unsupported export dtype {dtype!r}; choose one of {sorted(_EXPORT_DTYPES)}")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty")
    ckpt = read_gguf(gguf_path)
    tok = ckpt.tokenizer
    cfg = ckpt.hf_config

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        _write_json(staging / "config.json", {**cfg, "torch_dtype": dtype, "dtype": dtype})
        _write_safetensors(ckpt, _EXPORT_DTYPES[dtype], staging / "model.safetensors")
        (staging / "tokenizer.json").write_text(tok.tokenizer_json, encoding="utf-8")

        added = json.loads(tok.tokenizer_json)["added_tokens"]
        special = ckpt.special_tokens
        extra_special = [t["content"] for t in added if t["special"] and t["content"] not in special.values()]
        _write_json(staging / "special_tokens_map.json", {**special, "additional_special_tokens": extra_special})
        _write_json(staging / "tokenizer_config.json", {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special,
            "add_bos_token": tok.add_bos_token,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": cfg["max_position_embeddings"],
            **({"chat_template": tok.chat_template} if tok.chat_template else {}),
        })
        if tok.chat_template:
            (staging / "chat_template.jinja").write_text(tok.chat_template, encoding="utf-8")

        eos_ids = [cfg["eos_token_id"]] if "eos_token_id" in cfg else []
        eos_ids = list(dict.fromkeys(eos_ids + list(tok.eos_token_ids)))
        generation: dict[str, Any] = {k: cfg[k] for k in ("bos_token_id", "pad_token_id") if k in cfg}
        if eos_ids:
            generation["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
        _write_json(staging / "generation_config.json", generation)

        staging.chmod(0o755)  # mkdtemp creates 0700
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir
