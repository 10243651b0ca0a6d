"""The `kvserve` command line: serve, generate, chat, and bench (kvserve/entrypoints/bench.py).

Subcommands live in SUBCOMMANDS as name -> Subcommand(help, add_arguments, run); register() adds one. Heavy
imports (torch, the model) happen inside run functions so `kvserve --help` stays fast.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvserve.config import ATTENTION_BACKENDS, KV_CACHE_DTYPES, QUANTIZATION_CHOICES   # plain Python, as the next
from kvserve.entrypoints.openai.tool_parsers import TOOL_PARSERS   # plain Python: keeps --help fast
from kvserve.errors import KVServeError

DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MAX_WAITING_REQUESTS = 1024


@dataclass
class Subcommand:
    """A subcommand: fills its parser (or builds it on the subparsers itself, via add_parser) and runs."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None] | None
    run: Callable[[argparse.Namespace], int | None]
    add_parser: Callable[[Any], argparse.ArgumentParser] | None = None


SUBCOMMANDS: dict[str, Subcommand] = {}


def register(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None],
             run: Callable[[argparse.Namespace], int]) -> None:
    """Add (or replace) a subcommand."""
    SUBCOMMANDS[name] = Subcommand(help, add_arguments, run)


# ----- engine flags, shared by every subcommand that loads a model (vllm serve's names) -----
def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The EngineConfig flags."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", dest="model_flag", default=None,
                   help="HF directory or .gguf file (default: the bundled SmolLM2-135M-Instruct)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    g.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda")
    g.add_argument("--enforce-eager", action="store_true", default=None,
                   help="CUDA: run decode steps eagerly instead of replaying CUDA graphs captured at start")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule and launch each step before the last one's tokens are back, overlapping the "
                        "host's work with the device's (default: on for CUDA, off on the CPU)")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=None,
                   help="auto (the default): triton on CUDA, the C++ kernels on the CPU; torch: the plain-torch "
                        "reference; cpu; triton")
    g.add_argument("--quantization", "-q", choices=QUANTIZATION_CHOICES, default=None,
                   help="gguf: keep a .gguf file's quantized weights (the default on the CPU); int8: W8A8, any "
                        "checkpoint's linears quantized to int8 at load (CPU); none: weights in --dtype")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--max-num-seqs", type=int, default=None, help="most requests in one batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step (default: 1024 on CPU, 8192 on CUDA)")
    g.add_argument("--block-size", type=int, default=None, help="tokens per KV cache block")
    g.add_argument("--kv-cache-memory", default=None, help="KV cache size, e.g. 2GiB (default: 1 GiB on CPU)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                   help="auto: the model's dtype; fp8 (= fp8_e4m3), fp8_e5m2: one byte per K/V value, twice "
                        "bf16's tokens in the same memory (docs/quantization.md)")
    g.add_argument("--calculate-kv-scales", action="store_true", default=None,
                   help="FP8 KV: set each layer's K and V scales from the first step (default: 1.0)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="CUDA memory fraction when --kv-cache-memory is not given")
    g.add_argument("--seed", type=int, default=None,
                   help="seeds the sampling of requests that give no seed of their own (default 0)")
    g.add_argument("--chat-template", default=None, help="chat template file or inline Jinja")
    g.add_argument("--kv-offloading-size", default=None,
                   help="the prefix cache's second tier in host memory, GiB or e.g. 512MiB: blocks evicted from the "
                        "KV pool are kept there by hash and loaded back on a hit (default 0: none)")
    g.add_argument("--preemption-mode", choices=["recompute", "swap"], default=None,
                   help="swap: a preempted request's blocks are kept in the host tier and loaded back when it resumes "
                        "(default recompute)")
    g.add_argument("--swap-space", default=None,
                   help="the host tier's size under --preemption-mode swap without --kv-offloading-size (default 4 "
                        "GiB)")
    g.add_argument("--runner", choices=["auto", "generate", "pooling"], default=None,
                   help="pooling: embeddings only (/v1/embeddings, /score, /rerank); auto (default): a decoder "
                        "generates and embeds, an encoder (BERT) embeds (docs/embeddings.md)")
    g.add_argument("--enable-request-accounting", action="store_true", default=None,
                   help="usage.kvserve_accounting in every answer: prompt tokens computed and cached, KV "
                        "block-seconds, seconds queued, in prefill and in decode (docs/serving.md)")
    g.add_argument("--kv-transfer-config", default=None,
                   help='a KV connector as JSON, e.g. \'{"kv_connector": "SharedStorageConnector", "kv_role": '
                        '"kv_producer"}\': prompts\' KV saved to a store other engines load from (disaggregated '
                        "prefill/decode with kvserve proxy; docs/kv_transfer.md)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV cache of shared prompt prefixes (default: on)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="split long prompts across steps (default: on)")
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default=None,
                   help="fcfs, or priority: lower 'priority' values first; a waiting request preempts lower ones")
    g.add_argument("--priority-aging-s", type=float, default=None,
                   help="priority policy: seconds of waiting worth one priority level, so nothing starves "
                        "(default 10; 0 = strict priority)")
    g.add_argument("--num-threads", type=int, default=None, help="CPU threads for torch (default: all cores)")
    g.add_argument("--speculative-config", default=None,
                   help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\' '
                        "(methods: ngram, suffix, draft_model with \"model\"; docs/speculative_decoding.md)")
    g.add_argument("--grammar-compile-timeout-s", type=float, default=None,
                   help="structured outputs: refuse a request whose grammar has not compiled after this many "
                        "seconds (default 10)")
    g = p.add_argument_group("LoRA adapters (docs/lora.md)")
    g.add_argument("--enable-lora", action="store_true", default=None, help="serve LoRA adapters over the model")
    g.add_argument("--max-loras", type=int, default=None, help="most adapters in one step (default 1)")
    g.add_argument("--max-lora-rank", type=int, default=None, help="largest adapter rank (default 16)")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept loaded in memory, least recently used dropped first (default: --max-loras)")
    g = p.add_argument_group("parallelism (docs/distributed.md)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                   help="split the model's heads, MLP and vocabulary over this many ranks (default 1)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=None, help="only 1: not built")
    g.add_argument("--distributed-executor-backend", choices=["mp", "ray"], default=None,
                   help="mp: a worker process per extra rank on this machine (default); ray: ranks (and serve's "
                        "replicas) as Ray actors")
    g.add_argument("--ray-address", default=None,
                   help="the Ray cluster to join: auto, or HOST:PORT (default: start a local Ray instance)")


_ENGINE_FLAGS = ("tokenizer", "dtype", "device", "attention_backend", "enforce_eager", "async_scheduling", "quantization", "max_model_len", "max_num_seqs",
                 "max_num_batched_tokens", "block_size", "kv_cache_memory", "kv_cache_dtype", "calculate_kv_scales",
                 "gpu_memory_utilization", "seed", "chat_template", "enable_prefix_caching", "enable_chunked_prefill",
                 "kv_offloading_size", "preemption_mode", "swap_space", "kv_transfer_config", "runner",
                 "enable_request_accounting",
                 "scheduling_policy", "priority_aging_s", "num_threads", "speculative_config",
                 "grammar_compile_timeout_s", "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras",
                 "tensor_parallel_size", "pipeline_parallel_size", "distributed_executor_backend", "ray_address")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig keyword arguments of the flags given; flags left out keep EngineConfig's defaults."""
    return {name: getattr(args, name) for name in _ENGINE_FLAGS if getattr(args, name, None) is not None}


def engine_config_from_args(args: argparse.Namespace):
    from kvserve.config import EngineConfig
    return EngineConfig(model=model_arg(args), **engine_kwargs(args))


def model_arg(args: argparse.Namespace) -> str | None:
    """The model from MODEL or --model (both spellings of vllm serve)."""
    positional, flag = getattr(args, "model", None), getattr(args, "model_flag", None)
    if positional and flag and positional != flag:
        raise KVServeError(f"two models given: {positional!r} and --model {flag!r}")
    return positional or flag


def add_sampling_arguments(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help=f"tokens to generate (default {max_tokens})")
    g.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 or -1 = off")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g = p.add_argument_group("structured outputs (one of them; docs/structured_outputs.md)")
    g.add_argument("--json-schema", default=None, help="the output follows this JSON schema (JSON text or a file)")
    g.add_argument("--regex", default=None, help="the output matches this regex")
    g.add_argument("--choice", action="append", default=None, help="the output is one of these (repeatable)")
    g.add_argument("--grammar", default=None, help="the output follows this EBNF/GBNF grammar (text or a file)")


def sampling_params_from_args(args: argparse.Namespace, **extra):
    from kvserve.sampling_params import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          stop=args.stop, seed=args.seed, structured_outputs=_structured_outputs(args), **extra)


def _structured_outputs(args: argparse.Namespace) -> dict | None:
    """The constraint flags as StructuredOutputsParams fields; a schema or grammar may be given as a file."""
    fields = {"json": _text_or_file(args.json_schema), "regex": args.regex, "choice": args.choice,
              "grammar": _text_or_file(args.grammar)}
    fields = {k: v for k, v in fields.items() if v is not None}
    return fields or None


def _text_or_file(value: str | None) -> str | None:
    if value is not None and os.path.isfile(value):
        with open(value) as f:
            return f.read()
    return value


# ----- serve -----
def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="HF directory or .gguf file (default: bundled model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 = any free port")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health, /metrics and /version")
    p.add_argument("--max-request-body-size", default=None,
                   help="larger request bodies get 413, e.g. 8MiB (default: 4 MiB + 32 bytes per max_model_len token)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) the API accepts (default: MODEL, or SmolLM2-135M-Instruct)")
    p.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                   help="bound of the waiting queue; beyond it requests get 503 with Retry-After "
                        f"(default {DEFAULT_MAX_WAITING_REQUESTS})")
    p.add_argument("--log-format", choices=["text", "json"], default="text")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGINT/SIGTERM")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide when to call tools (tool_choice "auto", the default with tools); '
                        "needs --tool-call-parser")
    p.add_argument("--tool-call-parser", choices=list(TOOL_PARSERS), default=None,
                   help="how to find tool calls in the model's text: hermes (Qwen2.5, Hermes), llama3_json (Llama 3.x)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters to serve, as name=path or JSON '{\"name\": ..., \"path\": ..., "
                        "\"base_model_name\": ...}'; a request's model field picks one (needs --enable-lora)")
    p.add_argument("--enable-runtime-lora-updating", action="store_true",
                   help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (guarded by --api-key)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine replicas behind this server, as Ray actors (needs --distributed-executor-backend "
                        "ray); each may be tensor-parallel too (docs/distributed.md)")
    add_engine_arguments(p)


def run_serve(args: argparse.Namespace) -> int:
    from kvserve.config import parse_size
    from kvserve.entrypoints.openai.log_config import configure_logging

    configure_logging(args.log_format)
    # every flag is checked before the engine's imports (torch's seconds): a bad one fails at once
    if args.max_waiting_requests < 1:
        raise KVServeError("--max-waiting-requests must be >= 1")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise KVServeError("--enable-auto-tool-choice needs --tool-call-parser")
    config = engine_config_from_args(args)
    if (args.lora_modules or args.enable_runtime_lora_updating) and not config.enable_lora:
        raise KVServeError("--lora-modules and --enable-runtime-lora-updating need --enable-lora")
    modules = parse_lora_modules(args.lora_modules or [])
    names = args.served_model_name or [config.model or DEFAULT_SERVED_MODEL_NAME]
    for name, _, _ in modules:
        if name in names:
            raise KVServeError(f"--lora-modules: {name!r} is the base model's name; give the adapter another")
    if args.data_parallel_size != 1:
        _check_data_parallel(args, config)
    body_limit = None
    if args.max_request_body_size is not None:
        body_limit = parse_size(args.max_request_body_size, "max_request_body_size")
        if body_limit < 1:
            raise KVServeError("--max-request-body-size must be positive")
    from kvserve.engine.async_engine import AsyncLLMEngine
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.entrypoints.openai.api_server import ServerSettings, run_server
    from kvserve.lora import LoRARequest
    from kvserve.metrics import EngineMetrics
    if args.data_parallel_size != 1:
        from kvserve.distributed.dp_engine import DataParallelEngine
        engine = DataParallelEngine(config, args.data_parallel_size, names[0], args.max_waiting_requests)
    else:
        llm = LLMEngine(config)
        for name, path, base in modules:
            llm.lora.register(LoRARequest(name, llm.lora.next_id(), path, base_model_name=base or names[0]))
        engine = AsyncLLMEngine(llm, args.max_waiting_requests, EngineMetrics(names[0]))
    settings = ServerSettings(served_model_names=names, model_path=config.model, api_key=args.api_key,
                              max_request_body_bytes=body_limit, enable_auto_tool_choice=args.enable_auto_tool_choice,
                              tool_call_parser=args.tool_call_parser,
                              enable_runtime_lora_updating=args.enable_runtime_lora_updating)
    return run_server(engine, settings, args.host, args.port, args.shutdown_timeout)


def _check_data_parallel(args: argparse.Namespace, config) -> None:
    """--data-parallel-size N: N replicas on Ray behind this server (kvserve/distributed/dp_engine.py)."""
    if args.data_parallel_size < 1:
        raise KVServeError("--data-parallel-size must be >= 1")
    if config.distributed_executor_backend != "ray":
        raise KVServeError("--data-parallel-size runs its replicas on Ray: add --distributed-executor-backend ray")
    if config.enable_lora:
        raise KVServeError("LoRA adapters are not served by data-parallel replicas yet")


def parse_lora_modules(values: list[str]) -> list[tuple[str, str, str | None]]:
    """--lora-modules entries (name=path, or vLLM's JSON object) as (name, path, base model name or None)."""
    modules = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
            except json.JSONDecodeError as e:
                raise KVServeError(f"--lora-modules: {value!r} is not valid JSON: {e}") from None
            if not (isinstance(spec, dict) and isinstance(spec.get("name"), str) and isinstance(spec.get("path"), str)):
                raise KVServeError(f"--lora-modules: {value!r} needs string fields \"name\" and \"path\"")
            modules.append((spec["name"], spec["path"], spec.get("base_model_name")))
            continue
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise KVServeError(f"--lora-modules: {value!r} is neither name=path nor a JSON object")
        modules.append((name, path, None))
    if len({m[0] for m in modules}) != len(modules):
        raise KVServeError("--lora-modules: two adapters have the same name")
    return modules


# ----- generate -----
def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt to complete")
    add_sampling_arguments(p, max_tokens=64)
    add_engine_arguments(p)


def run_generate(args: argparse.Namespace) -> int:
    from kvserve.entrypoints.llm import LLM
    llm = LLM(model_arg(args), **engine_kwargs(args))
    out = llm.generate([args.prompt], sampling_params_from_args(args), use_tqdm=False)[0]
    print(out.outputs[0].text)
    return 0


# ----- chat -----
def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="HF directory or .gguf file (default: bundled model)")
    p.add_argument("--system", default=None, help="system prompt")
    add_sampling_arguments(p, max_tokens=256)
    add_engine_arguments(p)


def run_chat(args: argparse.Namespace) -> int:
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.sampling_params import RequestOutputKind
    engine = LLMEngine(engine_config_from_args(args))
    params = sampling_params_from_args(args, output_kind=RequestOutputKind.DELTA)
    ChatRepl(engine, params, args.system).run(sys.stdin, sys.stdout, sys.stderr)
    return 0


class ChatRepl:
    """Reads user lines, answers each with the model, streaming tokens as they come; keeps the conversation."""

    def __init__(self, engine, params, system: str | None = None):
        self.engine = engine
        self.params = params
        self.system = system
        self.history: list[dict] = []
        self.reset()

    def reset(self) -> None:
        self.history = [{"role": "system", "content": self.system}] if self.system else []

    def run(self, stdin, stdout, stderr) -> None:
        """Until EOF or /exit: /reset forgets the conversation; Ctrl-C stops the current answer."""
        interactive = stdin.isatty()
        if interactive:
            print("kvserve chat: /exit or Ctrl-D quits, /reset starts over, Ctrl-C stops an answer", file=stderr)
        while True:
            if interactive:
                print("> ", end="", file=stderr, flush=True)
            line = stdin.readline()
            if not line or line.strip() == "/exit":
                return
            text = line.strip()
            if text == "/reset":
                self.reset()
            elif text:
                self.turn(text, stdout, stderr)

    def turn(self, text: str, stdout, stderr) -> None:
        from kvserve.entrypoints.chat_utils import apply_chat_template
        from kvserve.errors import InvalidRequestError
        self.history.append({"role": "user", "content": text})
        try:
            ids = apply_chat_template(self.engine.tokenizer, self.history)
            request_id = self.engine.add_request(None, {"prompt_token_ids": ids}, self.params)
        except InvalidRequestError as e:
            self.history.pop()
            print(f"error: {e.message}", file=stderr)
            return
        reply = self._stream(request_id, stdout, stderr)
        self.history.append({"role": "assistant", "content": reply})

    def _stream(self, request_id: str, stdout, stderr) -> str:
        parts = []
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    parts.append(out.outputs[0].text)
                    stdout.write(out.outputs[0].text)
                    stdout.flush()
        except KeyboardInterrupt:
            self.engine.abort_request(request_id)
            print("\n[stopped]", file=stderr)
        stdout.write("\n")
        stdout.flush()
        return "".join(parts)


# ----- bench (kvserve/entrypoints/bench.py builds its own parser with subcommands) -----
def _add_bench_parser(subparsers) -> argparse.ArgumentParser:
    from kvserve.entrypoints.bench import add_bench_arguments
    return add_bench_arguments(subparsers)


def _run_bench(args: argparse.Namespace):
    from kvserve.entrypoints.bench import run_bench
    return run_bench(args)


register("serve", "serve a model over an OpenAI-compatible HTTP API", add_serve_arguments, run_serve)
register("generate", "complete one prompt and print the completion", add_generate_arguments, run_generate)
register("chat", "chat with a model in the terminal (streams tokens; /exit or EOF quits)", add_chat_arguments,
         run_chat)
SUBCOMMANDS["bench"] = Subcommand("offline throughput and latency benchmarks, and a serving client", None,
                                  _run_bench, add_parser=_add_bench_parser)


def _add_proxy_arguments(p: argparse.ArgumentParser) -> None:
    from kvserve.entrypoints.proxy import add_proxy_arguments
    add_proxy_arguments(p)


def _run_proxy(args: argparse.Namespace) -> int:
    from kvserve.entrypoints.proxy import run_proxy
    return run_proxy(args)


register("proxy", "disaggregated prefill/decode: each request's prefill on one instance, its decode on another "
         "(docs/kv_transfer.md)", _add_proxy_arguments, _run_proxy)


def build_parser() -> argparse.ArgumentParser:
    from kvserve import __version__
    parser = argparse.ArgumentParser(prog="kvserve", description="kvserve: LLM inference and serving")
    parser.add_argument("--version", action="version", version=f"kvserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, cmd in SUBCOMMANDS.items():
        if cmd.add_parser is not None:
            cmd.add_parser(sub)
        else:
            cmd.add_arguments(sub.add_parser(name, help=cmd.help, description=cmd.help))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of `kvserve` and `python -m kvserve`."""
    args = build_parser().parse_args(argv)
    if args.command != "serve":
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        status = SUBCOMMANDS[args.command].run(args)
        return status if isinstance(status, int) else 0
    except KVServeError as e:
        print(f"kvserve {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
