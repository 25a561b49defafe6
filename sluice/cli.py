"""Command line: `sluice serve`, `sluice models export-hf`, `sluice bench ...`."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional


# `sluice serve` speculates by default: drafts use only spare budget and blocks (see scheduler.py).
DEFAULT_SPECULATIVE = '{"method": "ngram"}'


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--kv-cache-tokens", type=int, default=None)
    kv.add_argument("--kv-cache-gib", type=float, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--max-state-snapshots", type=int, default=None, metavar="N",
                   help="hybrid models (GLM-5.3): recurrent-state snapshots kept for prefix caching, taken "
                        "out of the KV budget (default: up to --max-num-seqs, at most a quarter of the cache; "
                        "0: none, so no prefix-cache hits)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scheduling-policy", default="workflow", choices=["fcfs", "workflow"])
    p.add_argument("--max-waiting-requests", type=int, default=None)
    p.add_argument("--max-waiting-tokens", type=int, default=None)
    p.add_argument("--retention-ttl", type=float, default=10.0, help="seconds a finished workflow call's KV stays pinned")
    p.add_argument("--starvation-s", type=float, default=None,
                   help="workflow policy under KV pressure: a call waiting this long goes first (default 50)")
    p.add_argument("--admit-backlog-steps", type=float, default=2.0, metavar="STEPS",
                   help="GET /load welcomes no new workflow while this many steps' token budgets of "
                        "prompt tokens wait to be computed (default 2)")
    p.add_argument("--max-active-workflows", type=parse_max_active_workflows, default="auto",
                   metavar="N|auto|none",
                   help="GET /load welcomes no new workflow while N are in flight (a call running or "
                        "waiting, or KV retained for the next call); auto (the default): the fewest "
                        "that keep the engine busy, found as it runs; none: no bound")
    p.add_argument("--auto-overhead-band", type=parse_overhead_band, default=None, metavar="LOW,HIGH",
                   help="with --max-active-workflows auto: the share of the wall clock spent on fixed "
                        "step costs and idling that the bound steers between; a lower band keeps more "
                        "workflows in flight (throughput), a higher one fewer (latency) (default 0.06,0.09)")
    p.add_argument("--auto-step-ratio", type=parse_step_ratio, default=None, metavar="LOW,HIGH|none",
                   help="with --max-active-workflows auto: a cap on the bound by how long a step lasts "
                        "against what a typical call's own prompt costs: it rises only while the ratio is "
                        "under LOW and falls while it is over HIGH; none: no cap (default 0.8,1.0)")
    p.add_argument("--decode-yield-steps", type=int, default=1, metavar="N",
                   help="while prompt tokens wait, running decodes sit out up to N consecutive steps so "
                        "the prompts get them alone (lower time to first token); 0: every step carries "
                        "every decode (default 1)")
    p.add_argument("--close-step-tokens", type=parse_close_step_tokens, default=128, metavar="N|none",
                   help="once a step holds N tokens, the first prompt it completes closes it to further "
                        "prompt chunks, so that call's first token is not held back by work starting "
                        "in the same step; none: prompt chunks fill the token budget (default 128)")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--stall-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="calls the engine schedules nothing for this long (a scheduler fault) end with a 500 "
                        "instead of waiting forever (default 30)")
    p.add_argument("--chat-template", type=read_chat_template, default=None, metavar="PATH|TEMPLATE",
                   help="a Jinja chat template file (or the template itself) to use in place of the model's own")
    p.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="streamed calls get their tokens in chunks of at least N (the first and the last "
                        "chunk go at once); a call's own `stream_interval` may raise it (default 1)")
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads (default: all cores)")
    p.add_argument("--no-huge-pages", dest="huge_pages", action="store_false",
                   help="keep weights and KV cache on ordinary pages (default: transparent huge pages "
                        "where the kernel offers them)")
    # config.WEIGHT_FORMATS's values (config imports torch, which this module leaves to the engine)
    p.add_argument("--weight-format", choices=("auto", "native", "bf16"), default="auto",
                   help="native: a GGUF file's Q4_1 / Q8_0 weights of linear layers stay in their blocks in "
                        "memory and the CPU kernels dequantize them as they compute (the same bf16 values, so "
                        "the same outputs, from under a third of the memory traffic); bf16: dequantize every "
                        "weight at load; auto (default): native where the linears run on AMX tiles, bf16 on "
                        "the AVX-512 vector path, where the dequantization costs a loaded step more than it saves")
    p.add_argument("--step-trace", default=None, metavar="PATH",
                   help="append one JSON line per engine step: its batch shape and where its time went")
    p.add_argument("--speculative-config", default=DEFAULT_SPECULATIVE, metavar="JSON",
                   help='prompt-lookup speculative decoding, as vLLM\'s flag: \'{"method": "ngram", '
                        '"num_speculative_tokens": 16, "prompt_lookup_max": 3, "prompt_lookup_min": 2, '
                        '"adaptive": true}\' (missing keys take these defaults; this is the default; '
                        '"adaptive", sluice\'s: each request drafts a length of its own, from 6, up to '
                        'num_speculative_tokens; false: always num_speculative_tokens, as vLLM); "none": off')


def add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--api-key", default=os.environ.get("SLUICE_API_KEY"))
    p.add_argument("--metrics-require-auth", action="store_true")
    p.add_argument("--max-request-bytes", type=int, default=8 << 20)
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="SIGTERM: seconds in-flight calls may run while new ones get 503 (default 30)")
    p.add_argument("--max-n", type=int, default=16, help="bound on a request's n (default 16)")
    p.add_argument("--max-stop-strings", type=int, default=16)
    p.add_argument("--max-logprobs", type=int, default=20, help="bound on logprobs / top_logprobs (default 20)")
    p.add_argument("--log-requests", action="store_true")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="answer tool calls the model writes as `tool_calls` (tool_choice \"auto\"; needs --tool-call-parser)")
    p.add_argument("--tool-call-parser", default=None, choices=["hermes", "glm45", "glm47", "qwen3_coder", "qwen3_xml"],
                   help="the model's tool-call format: hermes (<tool_call>{json}</tool_call>), glm45 / glm47 "
                        "(GLM-4.5 to GLM-5.x: <tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>), "
                        "qwen3_coder / qwen3_xml (<tool_call><function=name><parameter=k>v</parameter></function></tool_call>)")
    p.add_argument("--default-chat-template-kwargs", type=parse_template_kwargs, default=None, metavar="JSON",
                   help="template variables every chat gets unless its chat_template_kwargs sets them, e.g. "
                        "'{\"enable_thinking\": false}'")
    p.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3", "glm45", "glm47"],
                   help="a thinking model's <think>...</think> text becomes the reply's `reasoning` (chat), "
                        "reasoning items (/v1/responses) and thinking blocks (/v1/messages)")
    p.add_argument("--reasoning-config", type=parse_json_object, default=None, metavar="JSON",
                   help="vLLM's: the thinking tags behind thinking_token_budget, e.g. '{\"reasoning_end_str\": "
                        "\"Time to answer.</think>\"}' (what is written when a thought reaches its budget); "
                        "without --reasoning-parser it needs reasoning_start_str and reasoning_end_str")
    p.add_argument("--responses-store-size", type=int, default=1024,
                   help="how many /v1/responses are kept for previous_response_id, least recently used "
                        "dropped first; 0 keeps none (default 1024)")
    p.add_argument("--fault-inject-after-steps", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--fault-inject-stall-after-steps", type=int, default=None, help=argparse.SUPPRESS)


def parse_close_step_tokens(text: str) -> Optional[int]:
    if text.strip().lower() == "none":
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a token count >= 0 or 'none', got {text!r}")
    return value


def parse_low_high(text: str, limit: float = float("inf")) -> tuple[float, float]:
    """`LOW,HIGH`: two numbers, 0 < LOW < HIGH < `limit`."""
    try:
        low, high = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH (two numbers), got {text!r}") from None
    if not 0.0 < low < high < limit:
        upper = f" < {limit:g}" if limit != float("inf") else ""
        raise argparse.ArgumentTypeError(f"expected 0 < LOW < HIGH{upper}, got {text!r}")
    return low, high


def parse_overhead_band(text: str) -> tuple[float, float]:
    """`--auto-overhead-band LOW,HIGH`: two fractions, 0 < LOW < HIGH < 1."""
    return parse_low_high(text, limit=1.0)


def parse_step_ratio(text: str):
    """`--auto-step-ratio LOW,HIGH`: 0 < LOW < HIGH; or `none` (no cap: "none")."""
    return "none" if text.strip().lower() == "none" else parse_low_high(text)


def parse_max_active_workflows(text: str):
    """`--max-active-workflows`: a positive integer, `auto`, or `none` (no bound: None)."""
    word = text.strip().lower()
    if word in ("auto", "none"):
        return None if word == "none" else "auto"
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, 'auto' or 'none', got {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, 'auto' or 'none', got {n}")
    return n


def read_chat_template(value: str) -> str:
    """`--chat-template`: a file's text, or the value itself when it is a template (it has Jinja
    syntax; vLLM's rule), so a mistyped path is an error instead of a one-line template."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if any(mark in value for mark in ("{{", "{%", "{#")):
        return value
    raise argparse.ArgumentTypeError(f"{value!r} is neither a file nor a Jinja template")


def parse_json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def parse_template_kwargs(text: str) -> dict:
    """`--default-chat-template-kwargs`: a JSON object whose names the template does not own."""
    from sluice.tokenizer import RESERVED_TEMPLATE_NAMES

    value = parse_json_object(text)
    taken = sorted(RESERVED_TEMPLATE_NAMES.intersection(value))
    if taken:
        raise argparse.ArgumentTypeError(f"may not set {', '.join(taken)}")
    return value


def parse_speculative_config(text: Optional[str]):
    """`--speculative-config`: JSON object, or none/off; raises ValueError with a usable message."""
    from sluice.config import SpeculativeConfig

    if text is None or text.strip().lower() in ("", "none", "off"):
        return None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config is not JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError("--speculative-config must be a JSON object")
    return SpeculativeConfig.from_dict(d)


def build_engine_config(args: argparse.Namespace):
    from sluice.config import CacheConfig, EngineConfig, SchedulerConfig, parse_dtype, reasoning_tags
    from sluice.model.loader import load_model_config, resolve_model_path

    model_path = resolve_model_path(args.model)
    model_cfg = load_model_config(model_path)
    max_len = args.max_model_len or model_cfg.max_position_embeddings
    # not given: SchedulerConfig's default
    step_ratio = {} if args.auto_step_ratio is None else \
        {"auto_step_ratio": None if args.auto_step_ratio == "none" else args.auto_step_ratio}
    return EngineConfig(
        model_path=str(model_path),
        model=model_cfg,
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_tokens=args.kv_cache_tokens,
            kv_cache_gib=args.kv_cache_gib,
            enable_prefix_caching=not args.no_prefix_caching,
            max_state_snapshots=args.max_state_snapshots,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max_len,
            policy=args.scheduling_policy,
            max_waiting_requests=args.max_waiting_requests,
            max_waiting_tokens=args.max_waiting_tokens,
            retention_ttl_s=args.retention_ttl,
            starvation_s=args.starvation_s,
            admit_backlog_steps=args.admit_backlog_steps,
            max_active_workflows=args.max_active_workflows,
            auto_overhead_band=args.auto_overhead_band,
            **step_ratio,
            decode_yield_steps=args.decode_yield_steps,
            close_step_tokens=args.close_step_tokens,
        ),
        dtype=parse_dtype(args.dtype),
        seed=args.seed,
        attention_backend=args.attention_backend,
        num_threads=args.num_threads,
        huge_pages=args.huge_pages,
        weight_format=args.weight_format,
        step_trace_path=args.step_trace,
        speculative=parse_speculative_config(args.speculative_config),
        stall_timeout_s=args.stall_timeout,
        stream_interval=args.stream_interval,
        chat_template=args.chat_template,
        # server flags (the parser splits replies) whose tags the engine needs for thinking budgets
        reasoning=reasoning_tags(getattr(args, "reasoning_parser", None), getattr(args, "reasoning_config", None)),
    )


def build_server_config(args: argparse.Namespace):
    from sluice.config import ServerConfig

    return ServerConfig(
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        metrics_require_auth=args.metrics_require_auth,
        max_request_bytes=args.max_request_bytes,
        shutdown_timeout_s=args.shutdown_timeout,
        max_n=args.max_n,
        max_stop_strings=args.max_stop_strings,
        max_logprobs=args.max_logprobs,
        log_requests=args.log_requests,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        default_chat_template_kwargs=args.default_chat_template_kwargs,
        responses_store_size=args.responses_store_size,
        fault_inject_after_steps=args.fault_inject_after_steps,
        fault_inject_stall_after_steps=args.fault_inject_stall_after_steps,
    )


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # oneDNN caches a GEMM primitive per input shape, and a continuous batch has a new token
    # count almost every step: bound the cache so resident memory stays flat (must be set
    # before torch loads oneDNN).
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "128")
    if argv and argv[0] == "bench":
        from sluice.bench.cli import main as bench_main

        return bench_main(argv[1:]) or 0

    parser = argparse.ArgumentParser(prog="sluice")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model with an OpenAI-compatible API")
    add_engine_args(serve)
    add_server_args(serve)
    sub.add_parser("bench", help="workflow benchmarks (see `sluice bench --help`)")
    models = sub.add_parser("models", help="model utilities")
    msub = models.add_subparsers(dest="models_command", required=True)
    exp = msub.add_parser("export-hf", help="write an HF folder (safetensors) from a GGUF file")
    exp.add_argument("gguf")
    exp.add_argument("out_dir")
    exp.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    msub.add_parser("fetch-default", help="download and extract the default model; print its path")
    args = parser.parse_args(argv)

    if args.command == "serve":
        from sluice.server.api_server import run_server

        try:
            engine_config = build_engine_config(args)
        except ValueError as e:
            parser.error(str(e))
        try:
            server_config = build_server_config(args)
        except ValueError as e:
            parser.error(str(e))
        return run_server(engine_config, server_config) or 0
    if args.command == "models":
        if args.models_command == "export-hf":
            from sluice.model.gguf_loader import export_hf

            export_hf(args.gguf, args.out_dir, dtype=args.dtype)
            print(args.out_dir)
            return 0
        if args.models_command == "fetch-default":
            from sluice.model.default import ensure_default_model

            print(ensure_default_model())
            return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
