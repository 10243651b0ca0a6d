"""Beam search (kvserve/engine/beam_group.py): LLM.beam_search equals transformers' generate(num_beams=...,
do_sample=False) on the bundled model in float32, sequences and scores, with and without the prefix cache, beams
ending in EOS included; the beams share the prompt's blocks (computed once); the server's use_beam_search equals
LLM.beam_search; bad parameters are refused."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.entrypoints.beam_search import BeamSearchParams
from kvserve.errors import InvalidRequestError

# the first finishes a beam on EOS early (a finished hypothesis ranks against the live ones), the second does not
PROMPTS = ["The capital of France is", "Once upon a time, in a small village,"]


def _hf_beams(hf, ids: list[int], width: int, n: int, length_penalty: float):
    x = torch.tensor([ids])
    with torch.no_grad():
        out = hf.generate(x, attention_mask=torch.ones_like(x), num_beams=width, num_return_sequences=width,
                          do_sample=False, max_new_tokens=n, length_penalty=length_penalty,
                          output_scores=True, return_dict_in_generate=True)
    return [s[len(ids):].tolist() for s in out.sequences], out.sequences_scores.tolist()


@pytest.mark.parametrize("caching", [True, False])
def test_beam_search_equals_transformers(hf_reference, caching):
    llm = LLM(dtype="float32", quantization="none", enable_prefix_caching=caching)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    for width, n, penalty in ((4, 8, 1.0), (2, 6, 0.5)) if caching else ((3, 5, 1.0),):
        params = BeamSearchParams(beam_width=width, max_tokens=n, length_penalty=penalty)
        results = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
        for ids, result in zip(prompts, results):
            want, scores = _hf_beams(hf_reference, ids, width, n, penalty)
            assert [s.tokens[len(ids):] for s in result.sequences] == want
            got = [s.cum_logprob / (len(s.tokens) - len(ids)) ** penalty for s in result.sequences]
            assert got == pytest.approx(scores, abs=2e-4)
            assert result.sequences[0].text == tok.decode(want[0], skip_special_tokens=True)
    if caching:   # the beams share the prompt's blocks: it is computed once, then one token a beam a step
        computed, schedule = [], llm.llm_engine.scheduler.schedule

        def counting():
            out = schedule()
            computed.append(out.num_batched_tokens)
            return out
        llm.llm_engine.scheduler.schedule = counting
        llm.reset_prefix_cache()
        llm.beam_search({"prompt_token_ids": list(range(1000, 1200))}, BeamSearchParams(beam_width=4, max_tokens=6))
        assert sum(computed) <= 200 + 4 * 5


def test_bad_beam_search_parameters_are_refused():
    llm = LLM()
    for params, field in ((BeamSearchParams(beam_width=0, max_tokens=4), "beam_width"),
                          (BeamSearchParams(beam_width=11, max_tokens=4), "beam_width"),
                          (BeamSearchParams(beam_width=2, max_tokens=0), "max_tokens"),
                          (BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7), "temperature"),
                          (BeamSearchParams(beam_width=2, max_tokens=10**6), "max_tokens")):
        with pytest.raises(InvalidRequestError) as e:
            llm.beam_search("hello", params)
        assert e.value.param == field


def test_use_beam_search_on_the_server_equals_llm_beam_search(server, client):
    """The session server (the bundled model, float32, kept quantized) and an engine with its settings."""
    from server_utils import MODEL
    llm = LLM(dtype="float32")
    prompt = "Once upon a time, in a small village,"
    want = llm.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=6))[0].sequences
    r = client.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=6,
                                  extra_body={"use_beam_search": True})
    assert [c.text for c in r.choices] == [s.text for s in want]
    assert r.usage.completion_tokens == 18 and [c.finish_reason for c in r.choices] == ["length"] * 3
    messages = [{"role": "user", "content": "Name a planet."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, n=2, max_tokens=5,
                                          extra_body={"use_beam_search": True})
    ids = llm.apply_chat_template(messages)
    want = llm.beam_search({"prompt_token_ids": ids}, BeamSearchParams(beam_width=2, max_tokens=5))[0]
    assert [c.message.content for c in chat.choices] == [s.text for s in want.sequences]
    import openai
    for kwargs, field in ((dict(stream=True), "use_beam_search"), (dict(n=11), "n"),
                          (dict(temperature=0.5), "temperature")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, extra_body={"use_beam_search": True},
                                      **{"n": 2, **kwargs})
        assert e.value.body["param"] == field
    for field, value in (("bad_words", ["a"]), ("allowed_token_ids", [5]), ("truncate_prompt_tokens", 4)):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, n=2,
                                      extra_body={"use_beam_search": True, field: value})
        assert e.value.body["param"] == field and e.value.body["code"] == "unsupported_parameter"


def test_beam_search_under_preemption_and_beside_other_requests_equals_a_roomy_engine():
    prompts = [{"prompt_token_ids": list(range(300 + 7 * i, 340 + 7 * i))} for i in range(3)]
    params = BeamSearchParams(beam_width=3, max_tokens=10)
    roomy = [[s.tokens for s in out.sequences] for out in LLM(block_size=4).beam_search(prompts, params)]
    tight = LLM(block_size=4, num_kv_blocks=40, max_num_batched_tokens=32)
    engine = tight.llm_engine
    ids = [engine.add_request(None, p, beam_search=params) for p in prompts]
    other = engine.add_request(None, {"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=30))
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert [[p["prompt_token_ids"] + o.token_ids for o in done[i].outputs] for i, p in zip(ids, prompts)] == roomy
    assert engine.scheduler.stats().num_preemptions > 0 and len(done[other].outputs[0].token_ids) == 30


def test_beam_searches_with_more_beams_than_seats_never_stall():
    """Held beams fill max_num_seqs while their groups' other beams wait: they are preempted, not waited for."""
    llm = LLM(block_size=4, num_kv_blocks=48, max_num_seqs=4)
    prompts = [{"prompt_token_ids": list(range(500 + 9 * i, 530 + 9 * i))} for i in range(4)]
    params = BeamSearchParams(beam_width=4, max_tokens=6)
    results = llm.beam_search(prompts, params)
    roomy = LLM(block_size=4).beam_search(prompts, params)
    assert [[s.tokens for s in r.sequences] for r in results] == [[s.tokens for s in r.sequences] for r in roomy]
