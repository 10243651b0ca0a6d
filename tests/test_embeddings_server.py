"""/v1/embeddings, /pooling, /score and /rerank on the shared `kvserve serve` process (the bundled decoder, pooled
at its last token): the openai SDK's embeddings.create (base64, its default) and encoding_format float agree,
batched inputs equal one-by-one ones, dimensions truncates and renormalizes, usage counts the tokens, scores are
the embeddings' cosines; bad input is a 400 naming the field."""
from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from server_utils import API_KEY, MODEL, post

pytestmark = pytest.mark.slow
TEXTS = ["The capital of France is Paris.", "Paris is in France.", "Bananas are yellow."]


def _embed(client, **kwargs) -> np.ndarray:
    return np.array([d.embedding for d in client.embeddings.create(model=MODEL, **kwargs).data])


def test_embeddings_through_the_openai_sdk(client, server):
    sdk = _embed(client, input=TEXTS)   # the SDK asks for base64 and decodes it
    floats = _embed(client, input=TEXTS, encoding_format="float")
    np.testing.assert_array_equal(sdk.astype(np.float32), floats.astype(np.float32))
    np.testing.assert_allclose(np.linalg.norm(floats, axis=1), 1.0, atol=1e-5)
    one_by_one = np.concatenate([_embed(client, input=t, encoding_format="float") for t in TEXTS])
    np.testing.assert_allclose(one_by_one, floats, atol=1e-6)
    short = _embed(client, input=TEXTS[0], encoding_format="float", dimensions=16)[0]
    np.testing.assert_allclose(short, floats[0, :16] / np.linalg.norm(floats[0, :16]), atol=1e-5)
    ids = [httpx.post(f"{server.url}/tokenize", json={"prompt": t}, headers={"Authorization": f"Bearer {API_KEY}"})
           .json()["count"] for t in TEXTS]
    assert client.embeddings.create(model=MODEL, input=TEXTS).usage.prompt_tokens == sum(ids)
    token_ids = _embed(client, input=[[1, 2, 3, 4]], encoding_format="float")
    assert token_ids.shape == (1, floats.shape[1])
    cut = _embed(client, input=[[9, 8, 1, 2, 3, 4]], encoding_format="float", extra_body={"truncate_prompt_tokens": 4})
    np.testing.assert_allclose(cut, token_ids, atol=1e-6)   # the input's last 4 tokens


def test_score_rerank_and_pooling_are_the_embeddings_cosines(client, server):
    vectors = _embed(client, input=TEXTS, encoding_format="float")
    score = post(server, "/score", {"model": MODEL, "text_1": TEXTS[0], "text_2": TEXTS[1:]}).json()
    np.testing.assert_allclose([d["score"] for d in score["data"]], vectors[1:] @ vectors[0], atol=1e-5)
    rerank = post(server, "/v1/rerank", {"model": MODEL, "query": TEXTS[0], "documents": TEXTS[1:], "top_n": 1})
    best = int(np.argmax(vectors[1:] @ vectors[0]))
    assert [r["index"] for r in rerank.json()["results"]] == [best]
    pooled = post(server, "/pooling", {"model": MODEL, "input": TEXTS[2]}).json()["data"][0]
    assert pooled["object"] == "pooling"
    np.testing.assert_allclose(pooled["data"], vectors[2], atol=1e-6)


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"), ({"input": [""]}, "input"), ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format"), ({"input": [[10**7]]}, "input"),
    ({"input": "x", "model": "gpt-4"}, "model"),
])
def test_bad_embedding_requests_are_refused(server, body, param):
    r = post(server, "/v1/embeddings", {"model": MODEL, **body})
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text
    with pytest.raises(openai.BadRequestError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0).embeddings.create(
            model=MODEL, input="x", dimensions=10**6)


def test_langchain_openai_embeddings_work_against_the_server(server, client):
    from langchain_openai import OpenAIEmbeddings
    emb = OpenAIEmbeddings(model=MODEL, base_url=f"{server.url}/v1", api_key=API_KEY,
                           check_embedding_ctx_length=False)   # no tiktoken: the server tokenizes
    docs = emb.embed_documents(TEXTS)
    np.testing.assert_allclose(docs, _embed(client, input=TEXTS, encoding_format="float"), atol=1e-6)
    np.testing.assert_allclose(emb.embed_query(TEXTS[0]), docs[0], atol=1e-6)
