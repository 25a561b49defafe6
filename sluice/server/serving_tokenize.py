"""POST /tokenize and POST /detokenize, as vLLM serves them: the token ids a prompt or a chat
becomes on this server (what a completion or chat completion with the same fields would run on),
and the text of token ids. Benchmark clients (`vllm bench serve`) use them to size prompts in the
server's own tokens."""
from __future__ import annotations

from typing import Any

from sluice.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from sluice.server.serving_base import OpenAIServing


def tokenize_request_model(body: Any) -> type[TokenizeChatRequest] | type[TokenizeCompletionRequest]:
    """vLLM's /tokenize body is a chat (`messages`) or a prompt (`prompt`)."""
    return TokenizeChatRequest if isinstance(body, dict) and "messages" in body else TokenizeCompletionRequest


class OpenAIServingTokenization(OpenAIServing):
    def tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        self.check_model(request.model)
        if isinstance(request, TokenizeChatRequest):
            ids = self.render_chat(request)
        else:
            ids = self.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens is not False)
        strs = [self.tokenizer.id_to_token(t) or "" for t in ids] if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs)

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        """The text of `tokens`, special tokens included (the inverse of /tokenize)."""
        self.check_model(request.model)
        self.check_token_ids(request.tokens, "tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens, skip_special_tokens=False))
