"""Beam search (kvserve/entrypoints/beam_search.py): LLM.beam_search equals transformers' generate(num_beams=...,
do_sample=False) on the bundled model in float32, sequences and scores, with and without the prefix cache, beams
ending in EOS included; the beams share their blocks through the prefix cache; bad parameters are refused."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM
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
    if caching:   # on a long prompt, every beam's step recomputes at most its last partial block
        before = llm.llm_engine.scheduler.stats()
        llm.beam_search({"prompt_token_ids": list(range(1000, 1200))}, BeamSearchParams(beam_width=4, max_tokens=6))
        after = llm.llm_engine.scheduler.stats()
        hits = after.prefix_cache_hits - before.prefix_cache_hits
        assert hits >= 0.9 * (after.prefix_cache_queries - before.prefix_cache_queries)


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
