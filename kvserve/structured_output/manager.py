"""StructuredOutputManager: compiles each request's constraint into an xgrammar grammar on a small thread pool,
cached by the constraint, so the engine thread never waits for a compilation."""
from __future__ import annotations

import copy
import json
import queue
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future

from kvserve.errors import InvalidRequestError, RequestFailedError
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured_output.request import StructuredOutputRequest

_MAX_CACHED = 1024          # compiled grammars kept (xgrammar keeps its own cache of the expensive parts too)
_XGRAMMAR_CACHE_BYTES = 256 << 20   # xgrammar's cache across constraints, bounded (unbounded by default)
_NUM_WORKERS = 2            # compilations at once; each uses one thread (the engine keeps the other cores)
_WHAT = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex", "choice": "choice",
         "grammar": "grammar"}


class StructuredOutputManager:
    """Compiles constraints for one tokenizer; thread-safe (the server's event loop and the engine both submit)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], compile_timeout_s: float):
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self._tokenizer = tokenizer
        self._stop_token_ids = list(stop_token_ids)
        self._lock = threading.Lock()            # the futures and the pool
        self._compiler_lock = threading.Lock()   # building the compiler (~1 s): never under _lock
        self._futures: OrderedDict[tuple, Future] = OrderedDict()
        self._pool: _DaemonPool | None = None
        self._compiler = None

    def submit(self, params: StructuredOutputsParams) -> Future:
        """The future compiled grammar of `params`: cached, or compiling on the pool from now on."""
        key = params.key
        with self._lock:
            fut = self._futures.get(key)
            if fut is not None and not fut.cancelled():
                self._futures.move_to_end(key)
                return fut
            if self._pool is None:
                self._pool = _DaemonPool(_NUM_WORKERS, "kvserve-grammar")
            fut = self._futures[key] = self._pool.submit(self._compile, params)
            while len(self._futures) > _MAX_CACHED:
                self._futures.popitem(last=False)
            return fut

    def new_request(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """The per-request state: waits for its grammar, at most compile_timeout_s from now."""
        return StructuredOutputRequest(self.submit(params), time.monotonic() + self.compile_timeout_s,
                                       self.compile_timeout_s)

    # ----- on the pool -----
    def _compile(self, params: StructuredOutputsParams):
        kind = params.kind
        try:
            compiler = self._get_compiler()
        except Exception as e:   # the server's fault, not the constraint's: not cached, a later request retries
            with self._lock:
                self._futures.pop(params.key, None)
            raise RequestFailedError(f"structured outputs are unavailable: building the grammar compiler failed: "
                                     f"{type(e).__name__}: {e}") from None
        try:
            if kind == "json":
                _check_supported(params.json)
                return compiler.compile_json_schema(json.dumps(params.json),
                                                    any_whitespace=not params.disable_any_whitespace)
            if kind == "json_object":   # any object: strict mode would forbid properties the schema does not list
                return compiler.compile_json_schema('{"type": "object"}', strict_mode=False,
                                                    any_whitespace=not params.disable_any_whitespace)
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(params.choice))
            return compiler.compile_grammar(params.grammar)
        except InvalidRequestError:
            raise
        except Exception as e:   # xgrammar raises RuntimeError (and a few others) naming the problem
            raise InvalidRequestError(f"structured_outputs: the {_WHAT[kind]} cannot be compiled: {_reason(e)}",
                                      "structured_outputs") from None

    def _get_compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr
                # a copy: HF fast tokenizers are not safe to share with the thread that detokenizes
                info = xgr.TokenizerInfo.from_huggingface(copy.deepcopy(self._tokenizer), vocab_size=self.vocab_size,
                                                          stop_token_ids=self._stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=_XGRAMMAR_CACHE_BYTES)
            return self._compiler


class _DaemonPool:
    """A few daemon worker threads: unlike ThreadPoolExecutor's, a compilation still running (past its time
    limit) never holds up the process's exit."""

    def __init__(self, num_workers: int, name: str):
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(num_workers):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

    def submit(self, fn, *args) -> Future:
        fut: Future = Future()
        self._tasks.put((fut, fn, args))
        return fut

    def _work(self) -> None:
        while True:
            fut, fn, args = self._tasks.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:   # the caller gets it from the future
                fut.set_exception(e)


# keywords whose values are maps of names to schemas (the names are not keywords), and those that hold data
_SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"}
_DATA = {"enum", "const", "default", "examples", "dependentRequired", "required"}


def _check_supported(schema) -> None:
    """Refuse what xgrammar accepts but does not enforce (it would let outputs through that fail the schema):
    `not`, `uniqueItems: true` and `allOf` of more than one schema."""
    stack = [(schema, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        what = ("not" if "not" in node else "uniqueItems" if node.get("uniqueItems") is True else
                "allOf with several schemas" if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1 else
                None)
        if what is not None:
            raise InvalidRequestError(f"structured_outputs: the JSON schema uses {what} (at {path or 'its root'}), "
                                      "which the grammar engine cannot enforce", "structured_outputs")
        for key, value in node.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                stack.extend((v, f"{path}.{key}.{name}") for name, v in value.items())
            elif key not in _DATA:
                stack.append((value, f"{path}.{key}"))


def choice_grammar(choices: list[str]) -> str:
    """EBNF matching exactly one of the strings (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _reason(e: Exception) -> str:
    """xgrammar's message without its C++ source location."""
    return _LOCATION.sub("", str(e).strip()).strip() or type(e).__name__
