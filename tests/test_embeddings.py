"""Pooling (embeddings): the BERT encoder family (all-MiniLM-L6-v2 against sentence-transformers, a tiny random
BERT against transformers), decoder models pooled as transformers' last hidden states pooled the same way, with
batching, chunked prefill, preemption, prefix caching and generation requests in the same steps; LLM.embed,
LLM.score; bad input refused."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from kvserve import LLM, SamplingParams
from kvserve.errors import ContextLengthExceededError, InvalidRequestError
from kvserve.pooling_params import PoolingParams

SENTENCES = ["The weather is lovely today.", "It's so sunny outside!", "He drove to the stadium.",
             "A man is playing a guitar on a stage in front of a small crowd of people who listen closely.",
             "Embeddings map sentences to vectors.", "ok"]


def _vectors(outs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outs])


@pytest.fixture(scope="module")
def minilm():
    from kvserve.model.loader import packaged_model_path
    try:
        return str(packaged_model_path("all-MiniLM-L6-v2"))
    except Exception as e:   # noqa: BLE001 - the reason is the skip message
        pytest.skip(f"all-MiniLM-L6-v2 is not installed (make setup installs it): {e}")


def test_minilm_embeddings_equal_sentence_transformers(minilm):
    from sentence_transformers import SentenceTransformer
    want = torch.from_numpy(SentenceTransformer(minilm, device="cpu").encode(SENTENCES))
    llm = LLM(model="all-MiniLM-L6-v2", max_num_batched_tokens=64)   # by name; a few sequences a step
    batched = _vectors(llm.embed(SENTENCES, use_tqdm=False))
    one_by_one = torch.cat([_vectors(llm.embed(s, use_tqdm=False)) for s in SENTENCES])
    for got in (batched, one_by_one):
        assert F.cosine_similarity(got, want).min() >= 0.9999
    assert torch.allclose(batched.norm(dim=1), torch.ones(len(SENTENCES)), atol=1e-5)
    short = _vectors(llm.embed(SENTENCES[:2], PoolingParams(dimensions=16), use_tqdm=False))
    assert torch.allclose(short, F.normalize(want[:2, :16], dim=1), atol=1e-4)
    [kitten, car] = llm.score("a cat", ["a kitten", "a car"], use_tqdm=False)
    assert kitten.outputs.score > car.outputs.score
    with pytest.raises(InvalidRequestError, match="encoder: it embeds"):
        llm.generate("hello", use_tqdm=False)
    with pytest.raises(ContextLengthExceededError, match="max_num_batched_tokens"):
        llm.embed({"prompt_token_ids": [101] * 100}, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="dimensions"):
        llm.embed("x", PoolingParams(dimensions=385), use_tqdm=False)
    # truncate_prompt_tokens keeps [CLS] and the text's end, as the tokenizer truncating from the left does
    tok = copy.deepcopy(llm.get_tokenizer())
    tok.truncation_side = "left"
    cut = tok(SENTENCES[0], truncation=True, max_length=6)["input_ids"]
    assert len(cut) == 6 and cut[0] == tok.cls_token_id and cut[-1] == tok.sep_token_id
    got = _vectors(llm.embed(SENTENCES[0], PoolingParams(truncate_prompt_tokens=6), use_tqdm=False))
    assert torch.equal(got, _vectors(llm.embed({"prompt_token_ids": cut}, use_tqdm=False)))


def _tiny_bert(path, **overrides):
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    config = BertConfig(vocab_size=200, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=96, max_position_embeddings=64, **overrides)
    model = BertModel(config, add_pooling_layer=False).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name:
                p.uniform_(0.5, 1.5) if name.endswith("weight") else p.normal_(0, 0.1)
    model.save_pretrained(str(path))
    return model


@pytest.mark.parametrize("act", ["gelu", "gelu_new"])
def test_a_bert_encoder_equals_transformers_pooled(tmp_path, gguf_path, act):
    """CLS by default (no sentence-transformers files), MEAN on request, not normalized: transformers' own hidden
    states pooled the same way; sequences of several lengths in one step."""
    reference = _tiny_bert(tmp_path, hidden_act=act)
    llm = LLM(model=str(tmp_path), tokenizer=gguf_path, dtype="float32")
    prompts = [[5, 17, 42, 9], [3] * 11 + [7], [150, 2]]
    for kind in ("CLS", "MEAN"):
        got = _vectors(llm.embed([{"prompt_token_ids": p} for p in prompts],
                                 PoolingParams(pooling_type=kind if kind == "MEAN" else None, normalize=False),
                                 use_tqdm=False))
        for row, ids in zip(got, prompts):
            with torch.no_grad():
                hidden = reference(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids))).last_hidden_state[0]
            want = hidden[0] if kind == "CLS" else hidden.mean(0)
            torch.testing.assert_close(row, want, atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from model_utils import save_tiny_model
    path = tmp_path_factory.mktemp("tiny-llama")
    return str(path), save_tiny_model("llama", path)


def _reference_hidden(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = model(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)), output_hidden_states=True)
    return out.hidden_states[-1][0]


PROMPTS = [list(range(10, 10 + n)) for n in (37, 9, 52, 20)]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decoder_pooling_equals_transformers_hidden_states_through_chunks_preemption_and_the_cache(
        tiny_llama, gguf_path, async_scheduling):
    """LAST and MEAN over transformers' last hidden states (after the final norm); prompts longer than a step's
    budget (chunked), a pool too small for all of them (preempted), run twice (the second LAST run hits the prefix
    cache), beside generation requests in the same steps; with async scheduling too (a pooling request's last
    chunk in flight is not scheduled again)."""
    path, reference = tiny_llama
    llm = LLM(model=path, tokenizer=gguf_path, dtype="float32", block_size=4, max_num_batched_tokens=16,
              num_kv_blocks=16, max_num_seqs=4, async_scheduling=async_scheduling)
    engine = llm.llm_engine
    for kind in ("LAST", "MEAN", "LAST"):
        params = PoolingParams(pooling_type=kind, normalize=kind == "MEAN")
        for first in (5, 6):   # first in line, growing: the pooling requests behind them are preempted
            engine.add_request(None, {"prompt_token_ids": [first, 6, 7]},
                               SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        ids = [engine.add_request(None, {"prompt_token_ids": p}, pooling_params=params) for p in PROMPTS]
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        for rid, prompt in zip(ids, PROMPTS):
            hidden = _reference_hidden(reference, prompt)
            want = hidden[-1] if kind == "LAST" else F.normalize(hidden.mean(0), dim=0)
            torch.testing.assert_close(torch.tensor(done[rid].outputs.embedding), want, atol=2e-5, rtol=1e-4)
        assert any(done[rid].metrics["num_preemptions"] for rid in ids)
    assert engine.scheduler.stats().prefix_cache_hits > 0


def test_a_pooling_runner_refuses_generation_and_bad_pooling_params(tiny_llama, gguf_path):
    llm = LLM(model=tiny_llama[0], tokenizer=gguf_path, dtype="float32", task="embed")
    hi = {"prompt_token_ids": [5, 6]}
    with pytest.raises(InvalidRequestError, match="runner='pooling'"):
        llm.generate(hi, use_tqdm=False)
    assert len(llm.embed(hi, use_tqdm=False)[0].outputs.embedding) == 64
    for bad, field in ((PoolingParams(pooling_type="MAX"), "pooling_type"), (PoolingParams(dimensions=0), "dimensions"),
                       (PoolingParams(normalize="yes"), "normalize")):
        with pytest.raises(InvalidRequestError) as e:
            llm.embed(hi, bad, use_tqdm=False)
        assert e.value.param == field
    with pytest.raises(InvalidRequestError, match="runner"):
        LLM(model=tiny_llama[0], runner="embedding")
