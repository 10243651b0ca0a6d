"""Structured outputs: what a grammar costs per output token, and how long grammars take to compile.

  python benchmarks/structured_outputs.py [--repeats 3] [--json benchmarks/results/structured_outputs.json]

Per-token overhead (bundled SmolLM2-135M, float32 unless --dtype, greedy, prefix caching off): the same prompts run
unconstrained and constrained by a JSON schema (an array of at least 200 small objects, so no output completes
before max_tokens=64 and both runs emit exactly as many tokens), at batch 1 (one request at a time, 4 prompts) and
with 32 concurrent requests. The two runs alternate --repeats times in one process; the medians are compared.
The grammar's own per-step work (filling the bitmask of every constrained row, applying it) is also timed alone.

Compile time: a fresh manager per measurement ("cold": the first compilation of an engine, which also builds
xgrammar's tokenizer index), a new schema on a warm manager ("warm"), and the same schema again ("cached"); for a
small and a large (40-property, nested, enum-heavy) schema, a regex and an EBNF grammar.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kvserve import LLM, SamplingParams
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured_output import StructuredOutputManager, build_grammar_bitmask

ROOT = Path(__file__).resolve().parent.parent
ITEM = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                         "name": {"type": "string"}, "done": {"type": "boolean"}},
        "required": ["id", "name", "done"], "additionalProperties": False}
LONG_ARRAY = {"type": "array", "items": ITEM, "minItems": 200}
# the same with a length-bounded string: xgrammar expands {"maxLength": n} into n optional characters, and filling
# a row inside such a string costs milliseconds instead of microseconds
BOUNDED_ITEM = {**ITEM, "properties": {**ITEM["properties"], "name": {"type": "string", "maxLength": 12}}}
BOUNDED_ARRAY = {**LONG_ARRAY, "items": BOUNDED_ITEM}
PROMPTS = ["List the tasks of a software project as JSON.", "Write a JSON array of todo items.",
           "Give me a list of groceries in JSON.", "Produce JSON records for a small library catalogue."]
MAX_TOKENS = 64


def large_schema() -> dict:
    props = {f"field_{i}": ({"enum": [f"v{i}_{j}" for j in range(20)]} if i % 3 == 0 else
                            {"type": "array", "items": ITEM, "maxItems": 5} if i % 3 == 1 else
                            {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                             "required": ["a"]}) for i in range(40)}
    return {"type": "object", "properties": props, "required": list(props)[:20], "additionalProperties": False}


def timed_generate(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)


def overhead(llm: LLM, repeats: int) -> dict:
    """Seconds per output token, unconstrained against constrained, at batch 1 and 32."""
    free = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    grammar = free.clone(structured_outputs=StructuredOutputsParams(json=LONG_ARRAY))
    result = {}
    for name, batches in (("batch 1", [[p] for p in PROMPTS]), ("batch 32", [PROMPTS * 8])):
        runs = {"unconstrained": [], "json schema": []}
        for _ in range(repeats):
            for label, params in (("unconstrained", free), ("json schema", grammar)):
                seconds = tokens = 0
                for prompts in batches:
                    s, n = timed_generate(llm, prompts, params)
                    seconds, tokens = seconds + s, tokens + n
                assert tokens == MAX_TOKENS * sum(map(len, batches)), (label, tokens)
                runs[label].append(seconds / tokens)
        base, con = statistics.median(runs["unconstrained"]), statistics.median(runs["json schema"])
        result[name] = {"unconstrained_ms_per_token": base * 1e3, "constrained_ms_per_token": con * 1e3,
                        "overhead": con / base - 1}
    return result


def bitmask_cost(llm: LLM, schema: dict, batch: int = 32, steps: int = 20) -> dict:
    """The grammar's work per step alone: filling `batch` rows inside a string, then applying them to the logits."""
    engine = llm.llm_engine
    reqs = []
    so = StructuredOutputsParams(json=schema)
    for i in range(batch):
        rid = f"bitmask-{i}"
        engine.add_request(rid, PROMPTS[i % 4], SamplingParams(max_tokens=1, structured_outputs=so))
        req = engine.scheduler.requests[rid]
        while not req.structured_output.is_ready():
            time.sleep(0.001)
        for t in engine.tokenizer.encode('[{"id": 1, "name": "a', add_special_tokens=False):
            assert req.structured_output.accept(t)
        reqs.append(req)
    logits = torch.randn(batch, engine.vocab_size)
    from kvserve.structured_output.request import apply_grammar_bitmask
    t0 = time.perf_counter()
    for _ in range(steps):
        mask = build_grammar_bitmask(reqs, engine.vocab_size)
    t1 = time.perf_counter()
    for _ in range(steps):
        apply_grammar_bitmask(logits.clone(), mask)
    t2 = time.perf_counter()
    engine.abort_request([r.request_id for r in reqs])
    return {"batch": batch, "fill_ms_per_step": (t1 - t0) / steps * 1e3,
            "apply_ms_per_step": (t2 - t1) / steps * 1e3}


def compile_times(llm: LLM) -> dict:
    engine = llm.llm_engine
    specs = {"small json schema": StructuredOutputsParams(json=ITEM),
             "large json schema": StructuredOutputsParams(json=large_schema()),
             "regex": StructuredOutputsParams(regex=r"[A-Z][a-z]{2,10}( [A-Z][a-z]{2,10}){0,3}, [0-9]{5}"),
             "ebnf grammar": StructuredOutputsParams(grammar='root ::= expr\nexpr ::= term (("+" | "-") term)*\n'
                                                             'term ::= [0-9]+ | "(" expr ")"')}

    def manager():
        return StructuredOutputManager(engine.tokenizer, engine.vocab_size, sorted(engine.eos_token_ids), 60.0)

    def compile_s(m, spec):
        t0 = time.perf_counter()
        m.submit(spec).result()
        return time.perf_counter() - t0

    out = {}
    for name, spec in specs.items():
        cold = compile_s(manager(), spec)
        warm_manager = manager()
        compile_s(warm_manager, StructuredOutputsParams(regex="warm-up"))
        warm = compile_s(warm_manager, spec)
        cached = compile_s(warm_manager, spec)
        out[name] = {"cold_ms": cold * 1e3, "warm_ms": warm * 1e3, "cached_ms": cached * 1e3}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/structured_outputs.json"))
    args = ap.parse_args()
    llm = LLM(dtype=args.dtype, enable_prefix_caching=False, quantization="none")
    llm.generate(PROMPTS, SamplingParams(max_tokens=8), use_tqdm=False)   # warm-up
    result = {"dtype": args.dtype, "torch_threads": torch.get_num_threads(), "compile": compile_times(llm),
              "bitmask": {"string": bitmask_cost(llm, LONG_ARRAY),
                          "string with maxLength": bitmask_cost(llm, BOUNDED_ARRAY)},
              "overhead": overhead(llm, args.repeats)}
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print("| run | unconstrained ms/token | JSON schema ms/token | overhead |\n|---|---:|---:|---:|")
    for name, r in result["overhead"].items():
        print(f"| {name} | {r['unconstrained_ms_per_token']:.2f} | {r['constrained_ms_per_token']:.2f} | "
              f"{r['overhead']:+.1%} |")
    for name, b in result["bitmask"].items():
        print(f"\nbitmask inside a {name}, {b['batch']} rows: fill {b['fill_ms_per_step']:.2f} ms, apply "
              f"{b['apply_ms_per_step']:.2f} ms per step")
    print()
    print("| grammar | cold ms | warm ms | cached ms |\n|---|---:|---:|---:|")
    for name, r in result["compile"].items():
        print(f"| {name} | {r['cold_ms']:.1f} | {r['warm_ms']:.1f} | {r['cached_ms']:.3f} |")


if __name__ == "__main__":
    main()
