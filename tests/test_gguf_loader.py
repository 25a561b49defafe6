"""GGUF reading and HF export, checked against transformers' own GGUF loader on SmolLM2-135M."""
from __future__ import annotations

import dataclasses
import json
import unicodedata
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize
from hypothesis import settings, given, strategies as st
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_reference import hf_model_fp32, hf_tokenizer
from sluice.model.default import ensure_default_model
from sluice.model.gguf_loader import GGUFCheckpoint, _unpermute_rotary, export_hf, read_gguf
from sluice.tokenizer import Tokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's fine, don't you think? We've seen it.",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    '{"key": [1, 2, 3], "nested": {"a": null}}  // trailing\tcomment',
    "spaces:  two   three    four\t\ttabs\n\n\nnewlines \r\n crlf   ",
    "   leading and trailing   ",
    "Numbers 12345 and 3.14159 and 1,000,000; year 2024-11-30.",
    "日本語のテキストとカタカナ、中文测试，한국어 텍스트",
    "Emoji: 😀👍🏽🇺🇸 and ❤️ — café naïve résumé Ångström",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|><|endoftext|>",
    "text<|im_end|>glued<file_sep>tokens <|im_start|> spaced",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "How are you?\nBe brief."},
    ],
    [
        {"role": "user", "content": "First question"},
        {"role": "assistant", "content": "First answer"},
        {"role": "user", "content": "Second question 😀"},
    ],
]

PROMPT = "The capital of France is Paris. The capital of Germany is"


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return ensure_default_model()


@pytest.fixture(scope="module")
def ckpt(gguf_path: Path) -> GGUFCheckpoint:
    return read_gguf(gguf_path)


@pytest.fixture(scope="module")
def tokenizer(ckpt: GGUFCheckpoint) -> Tokenizer:
    return Tokenizer(ckpt.tokenizer)


@pytest.fixture(scope="module")
def ref_tokenizer(gguf_path: Path):
    return hf_tokenizer(gguf_path)


@pytest.fixture(scope="module")
def ref_model(gguf_path: Path):
    torch.manual_seed(0)
    return hf_model_fp32(gguf_path)


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_matches_transformers(tokenizer: Tokenizer, ref_tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert ids == ref_tokenizer(text).input_ids
    for skip in (False, True):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == ref_tokenizer.decode(ids, skip_special_tokens=skip)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


_PIECES = st.one_of(
    st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<file_sep>", "<|im_start", "im_end|>", "\n",
                     " ", "  ", "\n\n", "user\n", "assistant\n", "2024", " 7", "é"]),
    st.text(min_size=0, max_size=200),
    st.text(alphabet="ab cd\n1234.,é😀", min_size=60, max_size=300),
)


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(_PIECES, max_size=12))
def test_encoding_piece_by_piece_with_the_cache_is_encoding_the_whole_text(tokenizer: Tokenizer, pieces: list[str]) -> None:
    """The server encodes the text between added tokens piece by piece, long pieces through a
    cache (an agent's calls resend their conversation): the ids are those of encoding the whole
    text at once, the first time and from the cache."""
    assert tokenizer._pieces is not None           # SmolLM2's tokenizer qualifies
    text = "".join(pieces)
    whole = tokenizer._tok.encode(text, add_special_tokens=False).ids
    assert tokenizer.encode(text) == whole
    assert tokenizer.encode(text) == whole


def test_the_piece_cache_hits_on_a_resent_conversation_and_stays_within_its_budget(ckpt: GGUFCheckpoint) -> None:
    tok = Tokenizer(ckpt.tokenizer)
    cache = tok._pieces
    assert cache is not None
    history = [{"role": "user", "content": "Tool result: " + "row %d, value %d; " % (i, i * i) * 20} for i in range(6)]
    def long_pieces(text: str) -> int:
        return sum(len(p) >= cache.MIN_CHARS for p in cache._split.split(text)[::2])

    system = long_pieces(tok.apply_chat_template(history[:1])) - 1   # the template's default system prompt
    lookups = 0
    for n in range(1, len(history) + 1):
        text = tok.apply_chat_template(history[:n])
        assert tok.encode(text) == tok._tok.encode(text, add_special_tokens=False).ids
        lookups += long_pieces(text)
    # Each message is encoded once; every later call finds it (and the system prompt) cached.
    assert lookups == sum(n + system for n in range(1, len(history) + 1))
    assert cache.misses == len(history) + system and cache.hits == lookups - cache.misses
    small = Tokenizer(ckpt.tokenizer)
    small._pieces.max_chars = 1000                  # a message is ~350 characters: two fit
    for n in range(1, len(history) + 1):
        text = small.apply_chat_template(history[:n])
        assert small.encode(text) == small._tok.encode(text, add_special_tokens=False).ids
        assert small._pieces._chars <= 1000 and len(small._pieces._cache) <= 3
    assert small._pieces.misses > len(history) + system     # evicted pieces were encoded again


def test_a_tokenizer_that_does_not_split_at_added_tokens_cleanly_encodes_whole_texts(ckpt: GGUFCheckpoint) -> None:
    """A normalizer, a byte-level prefix space (given to the first piece only), an added token
    that strips its neighbours' whitespace or added tokens matched in two passes would make
    piece-by-piece encoding differ: those tokenizers encode the whole text."""
    spec = json.loads(ckpt.tokenizer.tokenizer_json)
    variants = []
    variants.append({**spec, "normalizer": {"type": "NFC"}})
    pre = json.loads(json.dumps(spec["pre_tokenizer"]))
    pre["pretokenizers"][-1]["add_prefix_space"] = True
    variants.append({**spec, "pre_tokenizer": pre})
    added = [dict(t) for t in spec["added_tokens"]]
    added[2]["rstrip"] = True
    variants.append({**spec, "added_tokens": added})
    added = [dict(t) for t in spec["added_tokens"]]
    added[3]["normalized"] = not added[3].get("normalized", False)   # matched in a second pass
    variants.append({**spec, "added_tokens": added})
    variants.append({**spec, "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first"}})
    text = "<|im_start|>user\n" + "word " * 30 + "<|im_end|>\n  tail"
    for v in variants:
        tok = Tokenizer(dataclasses.replace(ckpt.tokenizer, tokenizer_json=json.dumps(v)))
        assert tok._pieces is None
        assert tok.encode(text) == tok._tok.encode(text, add_special_tokens=False).ids


def _split_numerals(text: str) -> list[str]:
    """Each numeric character on its own, as llama.cpp's first 'smollm' regex (\\p{N}) isolates them."""
    pieces: list[str] = []
    for ch in text:
        if unicodedata.category(ch).startswith("N") or not pieces or unicodedata.category(pieces[-1][-1])[0] == "N":
            pieces.append(ch)
        else:
            pieces[-1] += ch
    return pieces


@pytest.mark.parametrize("text", ["x½ ²3 ٣٤ Ⅻ", "pi≈ 3.14, 2⁵=32", " 7 8  9"])
def test_numerals_split_individually_like_llama_cpp(tokenizer: Tokenizer, ref_tokenizer, text: str) -> None:
    # llama.cpp's 'smollm' pre-tokenizer (like SmolLM2's original tokenizer.json) isolates every
    # numeric character before GPT-2's split; transformers' GGUF converter skips that step, which
    # only shows on numerals beside a space or other non-ASCII ones. Encoding each piece alone
    # with transformers reproduces llama.cpp's split.
    expected = [i for piece in _split_numerals(text) for i in ref_tokenizer(piece).input_ids]
    assert tokenizer.encode(text) == expected


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tokenizer: Tokenizer, ref_tokenizer, messages: list[dict], add_generation_prompt: bool
) -> None:
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    ref = ref_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == ref
    assert tokenizer.encode(ours) == ref_tokenizer(ref).input_ids


def test_special_tokens_match_transformers(ckpt: GGUFCheckpoint, tokenizer: Tokenizer, ref_tokenizer) -> None:
    assert (tokenizer.bos_token, tokenizer.eos_token) == (ref_tokenizer.bos_token, ref_tokenizer.eos_token)
    assert tokenizer.bos_token_id == ref_tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_ids == (ref_tokenizer.eos_token_id,)
    assert ckpt.tokenizer.add_bos_token is False
    assert tokenizer.vocab_size == len(ref_tokenizer) == ckpt.hf_config["vocab_size"]
    ref_special = {tid for tid, tok in ref_tokenizer.added_tokens_decoder.items() if tok.special}
    assert tokenizer.special_token_ids == ref_special


# ---------------------------------------------------------------------------------------------
# Config and weights
# ---------------------------------------------------------------------------------------------

def test_config_matches_transformers(ckpt: GGUFCheckpoint, ref_model) -> None:
    cfg, ref = ckpt.hf_config, ref_model.config
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert cfg[key] == getattr(ref, key), key
    assert cfg["rms_norm_eps"] == pytest.approx(ref.rms_norm_eps, rel=1e-6)
    assert cfg["rope_parameters"] == {"rope_theta": 100000.0, "rope_type": "default"} == dict(ref.rope_parameters)
    assert cfg["rope_theta"] == 100000.0


def test_tensors_match_transformers(ckpt: GGUFCheckpoint, ref_model) -> None:
    ref = ref_model.state_dict()
    seen = set()
    for name, tensor in ckpt.iter_tensors(torch.float32):
        assert tensor.dtype == torch.float32 and tensor.is_contiguous()
        if not torch.equal(tensor, ref[name]):
            torch.testing.assert_close(tensor, ref[name], rtol=0, atol=1e-6, msg=name)
        seen.add(name)
    assert seen == set(ref) - {"lm_head.weight"}  # tied: lm_head is the embedding
    assert set(ckpt.tensor_shapes()) == seen


def test_iter_tensors_casts_to_requested_dtype(ckpt: GGUFCheckpoint) -> None:
    name, tensor = next(ckpt.iter_tensors(torch.bfloat16))
    assert tensor.dtype == torch.bfloat16 and tuple(tensor.shape) == ckpt.tensor_shapes()[name]


@pytest.mark.parametrize("num_heads", [1, 3, 9])
def test_unpermute_rotary_inverts_llama_cpp(num_heads: int) -> None:
    head_dim, hidden = 8, 5
    hf = np.random.default_rng(num_heads).standard_normal((num_heads * head_dim, hidden)).astype(np.float32)
    # llama.cpp's convert_hf_to_gguf: per head, rows [x_0..x_{d/2-1}, y_0..] become [x_0, y_0, x_1, y_1, ...]
    gguf = hf.reshape(num_heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(hf.shape)
    assert np.array_equal(gguf[1], hf[head_dim // 2])
    assert np.array_equal(_unpermute_rotary(gguf, num_heads), hf)
    bias = hf[:, 0].copy()
    assert np.array_equal(_unpermute_rotary(gguf[:, 0].copy(), num_heads), bias)


def test_rejects_other_architectures(tmp_path: Path) -> None:
    path = tmp_path / "tiny-gpt2.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        read_gguf(path)


def _byte_alphabet() -> list[str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = iter(range(256, 512))
    return [chars.get(b) or chr(next(extra)) for b in range(256)]


def _write_tiny_llama(path: Path, hf: dict[str, np.ndarray], heads: int, kv_heads: int) -> None:
    """A small untied Llama GGUF as llama.cpp's converter writes one, in several storage types."""
    Q = gguf.GGMLQuantizationType
    hidden, layers = hf["model.embed_tokens.weight"].shape[1], 2
    tokens = _byte_alphabet() + ["Ġt", "he", "Ġthe", "<|endoftext|>", "<think>"]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(hf["model.layers.0.mlp.up_proj.weight"].shape[0])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 2) + [3, 4])
    writer.add_token_merges(["Ġ t", "h e", "Ġt he"])
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 2)
    writer.add_add_bos_token(True)

    def permute(w: np.ndarray, n: int) -> np.ndarray:  # llama.cpp convert_hf_to_gguf's LlamaModel.permute
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    gguf_names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                  "lm_head.weight": "output.weight"}
    kinds = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    storage = {"attn_q": Q.Q8_0, "attn_k": Q.BF16, "attn_v": Q.F16, "ffn_up": Q.Q8_0, "output.weight": Q.F16}
    for name, w in hf.items():
        if name in gguf_names:
            gname = gguf_names[name]
        else:
            _, _, layer, *rest = name.split(".")
            gname = f"blk.{layer}.{kinds['.'.join(rest[:-1])]}.weight"
        kind = gname.split(".")[2] if gname.startswith("blk.") else gname
        if kind == "attn_q":
            w = permute(w, heads)
        elif kind == "attn_k":
            w = permute(w, kv_heads)
        qtype = storage.get(kind, Q.F32)
        if qtype == Q.F32:
            writer.add_tensor(gname, w)
        else:
            writer.add_tensor(gname, quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_tiny_untied_gqa_llama_round_trips(tmp_path: Path) -> None:
    heads, kv_heads, head_dim, hidden, ffn, vocab = 4, 2, 16, 64, 96, 261
    rng = np.random.default_rng(0)
    hf = {"model.embed_tokens.weight": rng.standard_normal((vocab, hidden))}
    for layer in range(2):
        prefix = f"model.layers.{layer}."
        hf |= {
            prefix + "self_attn.q_proj.weight": rng.standard_normal((heads * head_dim, hidden)),
            prefix + "self_attn.k_proj.weight": rng.standard_normal((kv_heads * head_dim, hidden)),
            prefix + "self_attn.v_proj.weight": rng.standard_normal((kv_heads * head_dim, hidden)),
            prefix + "self_attn.o_proj.weight": rng.standard_normal((hidden, heads * head_dim)),
            prefix + "mlp.gate_proj.weight": rng.standard_normal((ffn, hidden)),
            prefix + "mlp.up_proj.weight": rng.standard_normal((ffn, hidden)),
            prefix + "mlp.down_proj.weight": rng.standard_normal((hidden, ffn)),
            prefix + "input_layernorm.weight": rng.standard_normal(hidden),
            prefix + "post_attention_layernorm.weight": rng.standard_normal(hidden),
        }
    hf |= {"model.norm.weight": rng.standard_normal(hidden), "lm_head.weight": rng.standard_normal((vocab, hidden))}
    hf = {k: v.astype(np.float32) for k, v in hf.items()}
    path = tmp_path / "tiny.gguf"
    _write_tiny_llama(path, hf, heads, kv_heads)

    ckpt = read_gguf(path)
    cfg = ckpt.hf_config
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (heads, kv_heads, head_dim)
    assert cfg["tie_word_embeddings"] is False and cfg["vocab_size"] == vocab and cfg["rms_norm_eps"] == 1e-6
    ours = dict(ckpt.iter_tensors())
    assert set(ours) == set(hf)  # lm_head included: the file has its own output matrix
    for name, expected in hf.items():
        # Q8_0 keeps ~1% of the largest weight in each 32-block; bf16 and f16 are closer.
        torch.testing.assert_close(ours[name], torch.from_numpy(expected), rtol=0.02, atol=0.05, msg=name)

    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    for name, tensor in ref.state_dict().items():
        assert torch.equal(ours[name], tensor), name

    tokenizer = Tokenizer(ckpt.tokenizer)
    ref_tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in ["the other theme", " the<think>x</think> <|endoftext|>", "héllo\n\n  the"]:
        assert tokenizer.encode(text) == ref_tok(text).input_ids
    assert tokenizer.encode("the")[0] == tokenizer.bos_token_id == vocab - 2
    assert tokenizer.special_token_ids == {vocab - 2}  # <think> is user-defined: matched whole, not special
    assert tokenizer.decode(tokenizer.encode("a<think>b")) == "a<think>b"


# ---------------------------------------------------------------------------------------------
# HF export
# ---------------------------------------------------------------------------------------------

def _prompt_ids(ref_tokenizer) -> torch.Tensor:
    return torch.tensor([ref_tokenizer(PROMPT).input_ids])


def test_export_float32_matches_gguf_model(gguf_path: Path, ref_model, ref_tokenizer, tmp_path: Path) -> None:
    out = export_hf(gguf_path, tmp_path / "smollm2-f32", dtype="float32")
    assert sorted(p.name for p in out.iterdir()) == sorted([
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
        "generation_config.json", "special_tokens_map.json",
    ])
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "float32"
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tok_config["model_max_length"] == 8192 and tok_config["add_bos_token"] is False
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = _prompt_ids(ref_tokenizer)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref_model(ids).logits, rtol=0, atol=1e-5)

    hf_tok = AutoTokenizer.from_pretrained(out)
    assert (hf_tok.bos_token, hf_tok.eos_token) == (ref_tokenizer.bos_token, ref_tokenizer.eos_token)
    for text in TEXTS:
        assert hf_tok(text).input_ids == ref_tokenizer(text).input_ids
    for messages in CONVERSATIONS:
        assert hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
            ref_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    sluice_tok = Tokenizer.from_hf_folder(out)
    assert sluice_tok.encode(TEXTS[9]) == ref_tokenizer(TEXTS[9]).input_ids
    assert sluice_tok.eos_token_ids == (2,)


def test_export_bfloat16_generates_like_cast_reference(
    gguf_path: Path, ref_model, ref_tokenizer, tmp_path: Path
) -> None:
    out = export_hf(gguf_path, tmp_path / "smollm2-bf16")  # bfloat16 is the default
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    model = AutoModelForCausalLM.from_pretrained(out, dtype="auto").eval()
    assert model.dtype == torch.bfloat16

    # The reference's weights cast to bf16, swapped into the fp32 reference module for one call
    # (its rotary inv_freq stays fp32, as it does in a model loaded with a bf16 dtype).
    ref_params = {name: t.to(torch.bfloat16) for name, t in ref_model.state_dict().items()}
    ref_params["lm_head.weight"] = ref_params["model.embed_tokens.weight"]  # keep them tied
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, ref_params[name]), name

    # Greedy tokens from the export; the cast reference must pick the same token at every step
    # (one teacher-forced forward pass instead of a second, slow bf16 generate on the CPU).
    prompt = _prompt_ids(ref_tokenizer)
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=ref_tokenizer.pad_token_id)
        ref_logits = torch.func.functional_call(ref_model, ref_params, (generated[:, :-1],)).logits
    assert ref_logits.dtype == torch.bfloat16
    new_tokens = generated[0, prompt.shape[1]:]
    assert len(new_tokens) == 6
    assert ref_logits[0, prompt.shape[1] - 1:].argmax(-1).tolist() == new_tokens.tolist()


def test_export_refuses_non_empty_dir(gguf_path: Path, tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        export_hf(gguf_path, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]
