"""Tokenizer and chat template, loaded from an HF folder or built from GGUF metadata."""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import jinja2
import jinja2.defaults
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


@dataclass
class TokenizerInfo:
    """Everything needed to build a Tokenizer, independent of where it was read from."""

    tokenizer_json: str                    # the `tokenizers` library's serialized tokenizer
    chat_template: Optional[str] = None
    bos_token: Optional[str] = None
    eos_token: Optional[str] = None
    add_bos_token: bool = False
    eos_token_ids: tuple[int, ...] = ()    # extra end-of-sequence ids (generation_config etc.)


class ChatTemplateError(ValueError):
    """The chat template rejected the messages (a user error, reported as 400)."""


# Pre-tokenizers that work within each piece of text between added tokens, the same wherever the
# piece stands (ByteLevel only without a prefix space, which it would give the first piece alone).
_PIECEWISE_PRE_TOKENIZERS = frozenset({"ByteLevel", "Digits", "Split", "Punctuation", "Whitespace",
                                       "WhitespaceSplit"})


def _piecewise_spec(tokenizer_json: str) -> Optional[list[str]]:
    """The added tokens' texts when encoding a text is encoding each piece between them on its own
    (no normalizer, pre-tokenizers that work within a piece, added tokens matched as they stand,
    in one pass), else None. `tokenizers` splits a text at its added tokens before anything else (leftmost,
    longest first), so then encode(a + special + b) == encode(a) + [special] + encode(b)."""
    spec = json.loads(tokenizer_json)
    if spec.get("normalizer") is not None:
        return None
    pre = spec.get("pre_tokenizer")
    steps = [] if pre is None else pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    for step in steps:
        if step.get("type") not in _PIECEWISE_PRE_TOKENIZERS:
            return None
        if step.get("type") == "ByteLevel" and step.get("add_prefix_space"):
            return None
    added = spec.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") or t.get("single_word") for t in added):
        return None
    # `tokenizers` matches tokens marked `normalized` in a second pass, after the others: one
    # pass (below) finds the same matches only when all are marked alike.
    if len({bool(t.get("normalized")) for t in added}) > 1:
        return None
    return [t["content"] for t in added if t.get("content")]


class _PieceCache:
    """Token ids of text pieces between added tokens, least recently used first out, up to
    `max_chars` of cached text. An agent's calls resend their whole conversation: every message
    but the newest was encoded before (session 43: a 1,240-token prompt took ~7 ms to encode on
    the server's event loop, 1.7% of a core at ~2.3 calls/s, on the cores the engine computes on)."""

    MIN_CHARS = 64          # shorter pieces are encoded each time (cheaper than the bookkeeping)

    def __init__(self, tok: HFTokenizer, added: list[str], max_chars: int = 4_000_000) -> None:
        self._tok = tok
        alternatives = sorted(set(added), key=len, reverse=True)   # longest first: leftmost-longest
        self._split = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")") if alternatives else None
        self._ids = {t: tok.token_to_id(t) for t in alternatives}
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._chars = 0
        self.max_chars = max_chars
        self.hits = self.misses = 0
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        pieces = self._split.split(text) if self._split is not None else [text]
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2:
                ids.append(self._ids[piece])          # an added token
            elif len(piece) < self.MIN_CHARS:
                if piece:
                    ids.extend(self._tok.encode(piece, add_special_tokens=False).ids)
            else:
                ids.extend(self._piece(piece))
        return ids

    def _piece(self, piece: str) -> list[int]:
        with self._lock:
            got = self._cache.get(piece)
            if got is not None:
                self._cache.move_to_end(piece)
                self.hits += 1
                return got
        got = self._tok.encode(piece, add_special_tokens=False).ids
        with self._lock:
            self.misses += 1
            if piece not in self._cache and len(piece) <= self.max_chars:
                self._cache[piece] = got
                self._chars += len(piece)
                while self._chars > self.max_chars:
                    old, _ = self._cache.popitem(last=False)
                    self._chars -= len(old)
        return got


# The variables apply_chat_template itself passes to the template.
RENDER_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools", "bos_token", "eos_token"})
# Every name a template variable from a request or the server's defaults may not take: those and
# the template environment's globals (jinja's default namespace and raise_exception).
RESERVED_TEMPLATE_NAMES = RENDER_VARIABLES | frozenset(jinja2.defaults.DEFAULT_NAMESPACE) | {"raise_exception"}


class Tokenizer:
    def __init__(self, info: TokenizerInfo) -> None:
        self._tok = HFTokenizer.from_str(info.tokenizer_json)
        self._tok.no_padding()
        self._tok.no_truncation()
        added = _piecewise_spec(info.tokenizer_json)
        self._pieces = _PieceCache(self._tok, added) if added is not None else None
        self.info = info
        self.bos_token = info.bos_token
        self.eos_token = info.eos_token
        self.bos_token_id = self._tok.token_to_id(info.bos_token) if info.bos_token else None
        eos = list(info.eos_token_ids)
        if info.eos_token and self._tok.token_to_id(info.eos_token) is not None:
            eos.insert(0, self._tok.token_to_id(info.eos_token))
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.special_token_ids = frozenset(
            tid for tid, tok in self._tok.get_added_tokens_decoder().items() if tok.special
        )
        self._template = None
        if info.chat_template:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = _raise_exception
            env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **_: json.dumps(
                x, indent=indent, ensure_ascii=ensure_ascii
            )
            self._template = env.from_string(info.chat_template)

    @property
    def reserved_template_names(self) -> frozenset[str]:
        """Names extra template variables may not take (RESERVED_TEMPLATE_NAMES; without a template,
        only those apply_chat_template passes)."""
        return RESERVED_TEMPLATE_NAMES if self._template is not None else RENDER_VARIABLES

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._pieces is not None:
            ids = self._pieces.encode(text)
        else:
            ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.info.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> Optional[str]:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Optional[list[dict]] = None,
        **kwargs: Any,
    ) -> str:
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        shadowed = sorted(self.reserved_template_names.intersection(kwargs))
        if shadowed:
            raise ChatTemplateError(f"template variables may not replace the template's own: {', '.join(shadowed)}")
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            # the template met a value it cannot use (e.g. a chat_template_kwargs value of the wrong type)
            raise ChatTemplateError(f"chat template error: {e}") from e

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> "Tokenizer":
        return cls(hf_folder_info(folder))


def hf_folder_info(folder: str | Path) -> TokenizerInfo:
    """The tokenizer of an HF folder: tokenizer.json, tokenizer_config.json (its chat template, or
    chat_template.jinja beside it), generation_config.json's end ids."""
    folder = Path(folder)
    tok_json = (folder / "tokenizer.json").read_text(encoding="utf-8")
    cfg: dict = {}
    if (folder / "tokenizer_config.json").exists():
        cfg = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    template = cfg.get("chat_template")
    if (folder / "chat_template.jinja").exists():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)

    def _tok_str(v: Any) -> Optional[str]:
        return v.get("content") if isinstance(v, dict) else v

    eos_ids: list[int] = []
    gen_cfg = folder / "generation_config.json"
    if gen_cfg.exists():
        e = json.loads(gen_cfg.read_text(encoding="utf-8")).get("eos_token_id")
        eos_ids = [e] if isinstance(e, int) else list(e or [])
    return TokenizerInfo(
        tokenizer_json=tok_json,
        chat_template=template,
        bos_token=_tok_str(cfg.get("bos_token")),
        eos_token=_tok_str(cfg.get("eos_token")),
        add_bos_token=bool(cfg.get("add_bos_token", False)),
        eos_token_ids=tuple(eos_ids),
    )
