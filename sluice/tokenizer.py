"""Tokenizer and chat template, loaded from an HF folder or built from GGUF metadata."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import jinja2
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


class Tokenizer:
    def __init__(self, info: TokenizerInfo) -> None:
        self._tok = HFTokenizer.from_str(info.tokenizer_json)
        self._tok.no_padding()
        self._tok.no_truncation()
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

    # The variables apply_chat_template itself passes to the template.
    _RENDER_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools", "bos_token", "eos_token"})

    @property
    def reserved_template_names(self) -> frozenset[str]:
        """Names extra template variables may not take: those apply_chat_template passes, and the
        template environment's own (range, namespace, raise_exception, ...)."""
        env = frozenset(self._template.environment.globals) if self._template is not None else frozenset()
        return self._RENDER_VARIABLES | env

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
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
        return cls(
            TokenizerInfo(
                tokenizer_json=tok_json,
                chat_template=template,
                bos_token=_tok_str(cfg.get("bos_token")),
                eos_token=_tok_str(cfg.get("eos_token")),
                add_bos_token=bool(cfg.get("add_bos_token", False)),
                eos_token_ids=tuple(eos_ids),
            )
        )
