"""Structured outputs in the engine (offline LLM, bundled model, float32): JSON schemas (hand-written and generated)
judged by jsonschema, regex, choice, an EBNF grammar, json_object; constrained greedy output equals unconstrained
output where that already fits; composition with batching, n > 1, chunked prefill, preemption, prefix caching,
speculative decoding and logprobs; bad constraints refused with a typed error while the engine serves the rest."""
import json
import random
import re
from concurrent.futures import Future

import jsonschema
import pytest
import torch
import xgrammar as xgr

from kvserve import LLM, SamplingParams
from kvserve.errors import InvalidRequestError
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured_output.request import GrammarBitmask, apply_grammar_bitmask

SCHEMAS = {
    "nested objects": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "array with min and max items": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 2, "maxItems": 3}},
        "required": ["tags"]},
    "enum and const": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "version": {"const": 2}, "ok": {"type": "boolean"}},
        "required": ["color", "version", "ok"]},
    "anyOf": {"type": "object", "properties": {
        "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 100}, {"type": "string", "maxLength": 8}]}},
        "required": ["value"]},
    "$ref and $defs": {"$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -50, "maximum": 50}, "y": {"type": "integer", "minimum": -50,
                                                                      "maximum": 50}},
        "required": ["x", "y"], "additionalProperties": False}},
        "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"]},
    "pattern": {"type": "object", "properties": {"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}},
                "required": ["phone"]},
    "nullable types": {"type": "object", "properties": {
        "nickname": {"type": ["string", "null"], "maxLength": 12}, "age": {"type": ["integer", "null"],
                                                                           "minimum": 0, "maximum": 120}},
        "required": ["nickname", "age"]},
    "array of objects": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9},
                                         "done": {"type": "boolean"}},
        "required": ["id", "done"], "additionalProperties": False}},
}


def generated_schema(rng: random.Random, depth: int = 0) -> dict:
    """A random schema over the features above; every value is bounded, so a complete output stays short."""
    kinds = ["string", "integer", "boolean", "enum", "nullable"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 12)}
    if kind == "integer":
        low = rng.randint(-100, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 100)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["a", "b", "cat", "dog", 1, 2, None, True], rng.randint(1, 4))}
    if kind == "nullable":
        return {"anyOf": [{"type": "null"}, generated_schema(rng, depth + 1)]}
    if kind == "array":
        low = rng.randint(0, 2)
        return {"type": "array", "items": generated_schema(rng, depth + 1), "minItems": low,
                "maxItems": low + rng.randint(0, 2)}
    names = rng.sample(["id", "name", "kind", "size", "tags", "meta"], rng.randint(1, 3))
    return {"type": "object", "properties": {n: generated_schema(rng, depth + 1) for n in names},
            "required": names[:rng.randint(0, len(names))], "additionalProperties": False}


GENERATED = {f"generated {i}": generated_schema(random.Random(i)) for i in range(8)}
GREEDY = dict(temperature=0, max_tokens=120)


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32")


def chat(llm, content: str, **params):
    out = llm.chat([{"role": "user", "content": content}], SamplingParams(**{**GREEDY, **params}), use_tqdm=False)
    return out[0].outputs[0]


def constrained(**kind) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kind)


def test_outputs_validate_against_many_schemas(llm):
    schemas = {**SCHEMAS, **GENERATED}
    conversations = [[{"role": "user", "content": f"Write a JSON value matching this schema: {json.dumps(s)}"}]
                     for s in schemas.values()]
    params = [SamplingParams(**GREEDY, structured_outputs=constrained(json=s, disable_any_whitespace=True))
              for s in schemas.values()]
    outputs = llm.chat(conversations, params, use_tqdm=False)
    for (name, schema), out in zip(schemas.items(), outputs):
        o = out.outputs[0]
        assert o.finish_reason == "stop", (name, o.text)
        jsonschema.validate(json.loads(o.text), schema)


def test_regex_choice_grammar_and_json_object(llm):
    o = chat(llm, "Give me a phone number.", structured_outputs=constrained(regex=r"\d{3}-\d{4}"))
    assert re.fullmatch(r"\d{3}-\d{4}", o.text) and o.finish_reason == "stop"
    choices = ["Paris", "London", "Berlin"]
    o = chat(llm, "Which city is the capital of Germany?", structured_outputs=constrained(choice=choices))
    assert o.text in choices and o.finish_reason == "stop"
    arithmetic = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= num | "(" expr ")"\nnum ::= [1-9] [0-9]?'
    o = chat(llm, "Write an arithmetic expression.", max_tokens=40, structured_outputs=constrained(grammar=arithmetic))
    assert re.fullmatch(r"[0-9+\-()]+", o.text)
    if o.finish_reason == "stop":   # a complete expression evaluates (one cut at max_tokens may not)
        assert isinstance(eval(o.text, {"__builtins__": {}}), int)
    o = chat(llm, "Return a JSON object with the keys name and color for a red apple.",
             structured_outputs=constrained(json_object=True, disable_any_whitespace=True))
    assert o.finish_reason == "stop" and isinstance(json.loads(o.text), dict)


def test_constrained_greedy_equals_unconstrained_when_that_already_fits(llm):
    prompts = ["What is the capital of France? Answer in one word.", "Is the sky blue? Answer yes or no.",
               "Write the number seven in digits."]
    for prompt in prompts:
        free = chat(llm, prompt, max_tokens=30)
        assert free.finish_reason == "stop"
        for so in (constrained(choice=[free.text, free.text + " and more", "zzz"]),
                   constrained(regex=re.escape(free.text) + "|other")):
            o = chat(llm, prompt, max_tokens=30, structured_outputs=so)
            assert o.token_ids == free.token_ids and o.text == free.text


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
# a shared first block, so later requests hit the prefix cache
PREFIX = "You are a helpful assistant who answers briefly and precisely. "
MIXED = [PREFIX + p for p in ("Describe a person as JSON.", "The capital of France is",
                              "Tell me about a person named Ann.", "Count to five:")]


def mixed_params(**extra):
    so = constrained(json=PERSON, disable_any_whitespace=True)
    return [SamplingParams(temperature=0, max_tokens=36, structured_outputs=so, **extra),
            SamplingParams(temperature=0, max_tokens=24),
            SamplingParams(temperature=0, max_tokens=36, structured_outputs=so, **extra),
            SamplingParams(temperature=0, max_tokens=24)]


def run_mixed(llm, **extra):
    return [[(o.token_ids, o.text) for o in out.outputs]
            for out in llm.generate(MIXED, mixed_params(**extra), use_tqdm=False)]


@pytest.fixture(scope="module")
def mixed_reference(llm):
    """Each request alone: constrained ones valid, unconstrained ones as without any grammar in the batch."""
    alone = [[(o.token_ids, o.text) for o in llm.generate([p], [sp], use_tqdm=False)[0].outputs]
             for p, sp in zip(MIXED, mixed_params())]
    for (ids, text), in alone[::2]:
        jsonschema.validate(json.loads(text), PERSON)
    return alone


@pytest.fixture(scope="module")
def mixed_reference_block8():
    """mixed_reference with blocks of 8, as the stress test's: the attention sums each KV block's share in turn,
    so another block size rounds differently and may flip a near-tie."""
    llm = LLM(dtype="float32", block_size=8)
    return [[(o.token_ids, o.text) for o in llm.generate([p], [sp], use_tqdm=False)[0].outputs]
            for p, sp in zip(MIXED, mixed_params())]


def test_batched_requests_equal_each_alone(llm, mixed_reference):
    assert run_mixed(llm) == mixed_reference


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                         "prompt_lookup_max": 3}], ids=["plain", "ngram"])
def test_chunked_prefill_preemption_prefix_caching_and_speculation(spec, mixed_reference_block8):
    # a 32-token budget chunks the later prompts and runs all four at once (about 120 tokens together, their
    # shared first block once), so 7 blocks (56 tokens, the longest request's room) must preempt, whether the grammar
    # is compiled by the first step or later (its requests then wait, and the others run first)
    stress = LLM(dtype="float32", max_num_batched_tokens=32, num_kv_blocks=7, block_size=8, max_num_seqs=4,
                 speculative_config=spec)
    sched = stress.llm_engine.scheduler
    assert run_mixed(stress) + run_mixed(stress) == mixed_reference_block8 + mixed_reference_block8
    assert sched.num_preemptions > 0 and sched.prefix_cache_hits > 0
    if spec:
        assert sched.spec_stats.num_draft_tokens > 0
    assert stress.llm_engine.kv.num_free_blocks == stress.llm_engine.num_kv_blocks


def test_n_samples_each_follow_the_grammar_and_logprobs_come_back(llm):
    so = constrained(json=PERSON)
    out = llm.generate(["Describe a person as JSON."], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=80,
                                                                       logprobs=2, structured_outputs=so),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 3
    for o in out.outputs:
        assert o.finish_reason == "stop"
        jsonschema.validate(json.loads(o.text), PERSON)
        assert len(o.logprobs) == len(o.token_ids) and all(t in lp for t, lp in zip(o.token_ids, o.logprobs))
    assert len({o.text for o in out.outputs}) > 1   # three samples, not one grammar path


@pytest.mark.parametrize("kind, value, what", [
    ("json", {"type": "object", "properties": {"a": {"type": "nonsense"}}}, "JSON schema"),
    ("json", '{"type": ', "not valid JSON"),
    ("regex", "(unclosed", "regex"),
    ("grammar", "root ::= missing_rule", "grammar"),
    ("grammar", "root ::= (", "grammar"),
    # accepted by xgrammar but not enforced: refused rather than letting invalid output through
    ("json", {"type": "integer", "not": {"const": 5}}, "uses not"),
    ("json", {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}, r"uniqueItems \(at"),
    ("json", {"allOf": [{"type": "integer"}, {"maximum": 2}]}, "allOf with several"),
])
def test_a_bad_constraint_is_a_typed_error_and_the_engine_serves_the_rest(llm, kind, value, what):
    with pytest.raises(InvalidRequestError, match=what) as e:
        llm.generate(["Hi", "Hello"], [SamplingParams(max_tokens=4),
                                       SamplingParams(max_tokens=4, structured_outputs={kind: value})],
                     use_tqdm=False)
    assert e.value.param == "structured_outputs"
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids


def nested(depth: int) -> dict:
    schema: dict = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("fields", [{}, {"regex": "a", "choice": ["a"]}, {"choice": []}, {"choice": ["a", 1]},
                                    {"json": 3}, {"json_object": False}, {"regex": ""}, {"unknown": 1},
                                    {"json": "[" * 100_000}, {"json": nested(100_000)}])
def test_malformed_structured_outputs_params_are_refused(fields):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(structured_outputs=fields)
    assert e.value.param == "structured_outputs"


def test_keywords_are_told_from_property_names(llm):
    """A property named like an unenforced keyword is fine; a one-schema allOf (as pydantic writes) is enforced."""
    schema = {"type": "object", "properties": {"not": {"type": "string", "maxLength": 8},
                                               "n": {"allOf": [{"type": "integer", "minimum": 5, "maximum": 9}]}},
              "required": ["not", "n"], "additionalProperties": False}
    o = chat(llm, "Write JSON.", structured_outputs=constrained(json=schema, disable_any_whitespace=True))
    jsonschema.validate(json.loads(o.text), schema)


def test_a_compiling_grammar_holds_only_its_own_request(llm):
    """The queue goes on around a request whose grammar is still compiling; past the deadline it fails."""
    engine = llm.llm_engine
    engine.add_request("slow", "Hi", SamplingParams(temperature=0, max_tokens=3,
                                                    structured_outputs=constrained(regex="[a-z]+")))
    pending = Future()   # a compilation that has not finished
    slow = engine.scheduler.requests["slow"]
    slow.structured_output.grammar = pending
    engine.add_request("fast", "Hello", SamplingParams(temperature=0, max_tokens=3))
    finished = {}
    while "fast" not in finished:
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert "slow" not in finished and [r.request_id for r in engine.scheduler.waiting] == ["slow"]
    slow.structured_output.deadline = 0   # past its deadline: refused, not held forever
    engine.step()
    error = engine.take_failed_requests()["slow"]
    assert isinstance(error, InvalidRequestError) and "longer than" in error.message
    assert not engine.has_unfinished_requests()


def test_drafts_the_grammar_forbids_are_rejected():
    """n-gram drafts continue the prompt's pattern (', 1, 2'); the grammar ends the output after ' 5' instead: the
    draft rows must be masked as if the drafts before them were output, or the target accepts the forbidden ones."""
    llm = LLM(dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                   "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    prompt = "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3,"
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12,
                                                structured_outputs=constrained(regex=" 4, 5!")), use_tqdm=False)
    assert out[0].outputs[0].text == " 4, 5!"
    stats = llm.llm_engine.scheduler.spec_stats
    assert stats.num_accepted_tokens >= 3   # the draft rows ran: ' 4, 5' came from accepted drafts


@pytest.mark.parametrize("vocab_size", [1000, 4096, 49152])
def test_the_bitmask_kernel_equals_xgrammars(vocab_size):
    """Random masks (whole words set and clear among them), odd vocabularies, a subset of the rows."""
    g = torch.Generator().manual_seed(vocab_size)
    bitmask = torch.randint(-2**31, 2**31 - 1, (6, (vocab_size + 31) // 32), dtype=torch.int32, generator=g)
    bitmask[1, ::3] = -1
    bitmask[4, ::2] = 0
    logits = torch.randn(6, vocab_size, generator=g)
    rows = [0, 1, 4, 5]
    ours, theirs = logits.clone(), logits.clone()
    apply_grammar_bitmask(ours, GrammarBitmask(bitmask, rows))
    xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=vocab_size, indices=rows)
    assert torch.equal(ours, theirs) and torch.equal(ours[[2, 3]], logits[[2, 3]])
    assert torch.isinf(ours[rows]).any()


def test_min_tokens_holds_a_grammar_open_until_it_must_end(llm):
    """Under min_tokens a constrained row forbids the stop tokens where the grammar allows going on; where it
    allows only its end, the grammar wins and the request ends there (no forbidden token is ever emitted)."""
    prompt = "Is the sky blue? Answer in one word."
    free = chat(llm, prompt, structured_outputs=constrained(regex="[a-z]+"))
    assert free.finish_reason == "stop"
    held = chat(llm, prompt, min_tokens=len(free.token_ids) + 3, structured_outputs=constrained(regex="[a-z]+"))
    assert len(held.token_ids) >= len(free.token_ids) + 3 and re.fullmatch("[a-z]+", held.text)
    eos = llm.get_tokenizer().eos_token_id
    for temperature in (0, 1.0):
        o = chat(llm, prompt, temperature=temperature, seed=1, min_tokens=5, logprobs=1,
                 structured_outputs=constrained(choice=["yes"]))
        assert o.text == "yes" and o.finish_reason == "stop" and o.token_ids[-1] == eos
        # ended where the grammar did ("yes" may come as one token or as several: a draw may take either)
        assert llm.get_tokenizer().decode(o.token_ids[:-1]) == "yes" and eos not in o.token_ids[:-1]


def test_names_under_keywords_that_hold_names_are_not_keywords():
    from kvserve.structured_output.manager import _check_supported
    _check_supported({"type": "object", "properties": {"not": {}, "allOf": {}}, "dependentRequired": {"not": ["a"]},
                      "dependencies": {"uniqueItems": ["b"]}, "required": ["not"], "enum": [{"not": 1}]})
    with pytest.raises(InvalidRequestError, match="uses not"):
        _check_supported({"type": "object", "dependencies": {"a": {"not": {"required": ["b"]}}}})


def test_a_compiler_that_fails_to_build_fails_the_request_uncached(llm, monkeypatch):
    """Building the grammar compiler failing is the server's fault: the request fails (a 500 on the server), the
    failure is not cached, and once the compiler builds, the same constraint compiles."""
    from kvserve.errors import RequestFailedError
    from kvserve.structured_output import StructuredOutputManager
    engine = llm.llm_engine
    manager = StructuredOutputManager(engine.tokenizer, engine.vocab_size, sorted(engine.eos_token_ids), 10.0)
    monkeypatch.setattr(engine, "structured_output", manager)
    build = manager._get_compiler

    def broken():
        raise MemoryError("no room for the vocabulary index")
    monkeypatch.setattr(manager, "_get_compiler", broken)
    so = constrained(regex="[a-z]+")
    with pytest.raises(RequestFailedError, match="building the grammar compiler failed"):
        llm.generate(["Hi"], SamplingParams(max_tokens=3, structured_outputs=so), use_tqdm=False)
    monkeypatch.setattr(manager, "_get_compiler", build)
    o = llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=3, structured_outputs=so), use_tqdm=False)
    assert re.fullmatch("[a-z]+", o[0].outputs[0].text)
