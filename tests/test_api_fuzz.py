"""Every field of every JSON route, set in turn to values of every JSON type, through the real app and engine:
the answer is a 200 or a 4xx with OpenAI's error body, never a 500, and the server keeps serving (hypothesis)."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from hypothesis import given, settings, strategies as st

from kvserve.config import EngineConfig
from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.llm_engine import LLMEngine
from kvserve.entrypoints.openai.api_server import ServerSettings, build_app
from kvserve.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                 TokenizeRequest)
from model_utils import save_tiny_model, write_tiny_gguf

pytestmark = pytest.mark.slow

ROUTES = {
    "/v1/completions": (CompletionRequest, {"prompt": "hi", "max_tokens": 1}),
    "/v1/chat/completions": (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 1}),
    "/tokenize": (TokenizeRequest, {"prompt": "hi"}),
    "/detokenize": (DetokenizeRequest, {"tokens": [1, 2]}),
}
# a valid value here would only make the example slow (many tokens to generate), not more telling
LENGTH_FIELDS = {"max_tokens", "max_completion_tokens", "min_tokens"}
# every field gets each of these: the edges of 64-bit integers and floats, a lone surrogate, long and empty text,
# empty and nested containers
EDGE_VALUES = [0, -1, 1, 2**31, 2**63, 2**64, 2**80, -2**63 - 1, -2**80, 1e308, -1e308, 5e-324, 0.5, -0.5, True,
               False, None, "", "\ud800", "x" * 3000, [], {}, [[]], [None], {"": {"": []}}, [1] * 300,
               {"\udc00": 1}, [{"\ud800": "x"}]]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12)


@pytest.fixture(scope="module")
def post(tmp_path_factory, gguf_path):
    """The app on a tiny random Llama shaped as the bundled model's file is (a GGUF kept quantized, its embedding
    table tied to the output head) with the bundled model's tokenizer and vocabulary: the fuzz is about what the
    server makes of a body, and each of its hundreds of accepted requests runs a step (the bundled model's weights
    would only make them slower). The priority policy, so that `priority` reaches the scheduler (fcfs ignores
    it)."""
    from kvserve.model.tokenizer import load_gguf_tokenizer
    root = tmp_path_factory.mktemp("fuzz")
    hf = save_tiny_model("llama", root / "hf", vocab_size=len(load_gguf_tokenizer(gguf_path)),
                         tie_word_embeddings=True)
    path = write_tiny_gguf(root / "tiny.gguf", hf, qtype="Q8_0")
    engine = LLMEngine(EngineConfig(model=str(path), tokenizer=gguf_path, dtype="float32", max_model_len=128,
                                    num_kv_blocks=32, max_num_seqs=4, scheduling_policy="priority"))
    assert engine.weights_summary.startswith("GGUF kept quantized")
    async_engine = AsyncLLMEngine(engine)
    app = build_app(async_engine, ServerSettings(served_model_names=["m"]))
    loop = asyncio.new_event_loop()

    async def start():
        async_engine.start()
    loop.run_until_complete(start())
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://m", timeout=60)

    def send(path: str, body: dict) -> httpx.Response:
        return loop.run_until_complete(client.post(path, content=json.dumps(body)))
    send.app = app
    yield send
    loop.run_until_complete(async_engine.stop())
    loop.run_until_complete(client.aclose())
    loop.close()
    assert not engine.has_unfinished_requests() and engine.kv.num_free_blocks == engine.num_kv_blocks


def test_openapi_declares_every_json_body(post):
    """Handlers parse their bodies themselves; the schema still says what they take (for /docs and fuzzers)."""
    schema = post.app.openapi()
    for path, (model_cls, _) in ROUTES.items():
        ref = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model_cls.__name__}"
        assert set(schema["components"]["schemas"][model_cls.__name__]["properties"]) == set(model_cls.model_fields)
    assert "ChatMessage" in schema["components"]["schemas"]


def fields_of(model_cls) -> list[str]:
    return sorted(model_cls.model_fields)


def check_answer(post, path: str, base: dict, field: str, value) -> None:
    if field in LENGTH_FIELDS and isinstance(value, int) and not isinstance(value, bool) and 4 < value <= 200:
        value %= 5
    r = post(path, {**base, field: value})
    assert r.status_code < 500, (field, value, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and err["type"] == "invalid_request_error", r.text
    else:
        assert "server_error" not in r.text, (field, value, r.text)   # streamed errors arrive in a 200


@pytest.mark.parametrize("path", list(ROUTES))
def test_every_field_with_edge_and_random_json_values_is_answered_without_a_server_error(post, path):
    model_cls, base = ROUTES[path]
    for field in fields_of(model_cls):
        for value in EDGE_VALUES:
            check_answer(post, path, base, field, value)

    @settings(max_examples=30, deadline=None, database=None)
    @given(st.sampled_from(fields_of(model_cls)), json_values)
    def check_random(field, value):
        check_answer(post, path, base, field, value)
    check_random()
    assert post(path, base).status_code == 200   # still serving
