"""Disaggregated prefill/decode over HTTP: `kvserve proxy` in front of a prefill instance (kv_producer) and two
decode instances (kv_consumer) sharing a SharedStorageConnector store. Answers equal one server's (the session
server, the same flags); the decode instances load the prompts' KV; a bad request gets the prefill instance's 400;
a decode instance killed mid-stream ends that stream with an error naming the request, and the proxy serves the
next request on the other one; with the prefill instance killed, the decode instance computes the prompts."""
from __future__ import annotations

import json
import os
import signal

import httpx
import openai
import pytest

from server_utils import API_KEY, MODEL, SERVER_FLAGS, ServerProcess, metric

PROMPT = ("The history of the Roman empire is long and complicated, and many books have been written about it. "
          "Its roads, its laws and its language shaped the continent for centuries, and in this essay")


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    store = str(tmp_path_factory.mktemp("kv-store"))

    def connector(role):
        return json.dumps({"kv_connector": "SharedStorageConnector", "kv_role": role,
                           "kv_connector_extra_config": {"shared_storage_path": store}})
    prefill = ServerProcess(*SERVER_FLAGS, "--kv-transfer-config", connector("kv_producer"))
    decodes = [ServerProcess(*SERVER_FLAGS, "--kv-transfer-config", connector("kv_consumer")) for _ in range(2)]
    proxy = ServerProcess("--prefill", prefill.url, *(f for d in decodes for f in ("--decode", d.url)),
                          command="proxy")
    procs = [prefill, *decodes, proxy]
    try:
        for p in procs:
            p.wait_ready()
        yield prefill, decodes, proxy
    finally:
        for p in procs:
            p.stop(signal.SIGKILL)
            os.unlink(p.log.name)


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _loaded(decodes) -> float:
    return sum(metric(d, "kvserve:kv_transfer_loaded_blocks_total") for d in decodes if d.proc.poll() is None)


def test_answers_through_the_proxy_equal_one_servers(pd, server):
    prefill, decodes, proxy = pd
    via, direct = _client(proxy), _client(server)
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert via.completions.create(**kwargs).choices[0].text == direct.completions.create(**kwargs).choices[0].text
    assert _loaded(decodes) >= 2 and metric(prefill, "kvserve:kv_transfer_saved_blocks_total") >= 2
    messages = [{"role": "user", "content": PROMPT + " what came first?"}]
    stream = via.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    want = direct.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert text == want.choices[0].message.content
    # the prefill instance refuses it, and the proxy answers with that: the decode instances never see it
    r = httpx.post(f"{proxy.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "temperature": -1},
                   headers={"Authorization": f"Bearer {API_KEY}", "X-Request-Id": "pd-bad-temperature"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    assert prefill.wait_output("pd-bad-temperature")
    assert all("pd-bad-temperature" not in d.output() for d in decodes)
    assert httpx.post(f"{proxy.url}/v1/completions", content=b"{", timeout=30).status_code == 400


def test_a_decode_instance_killed_mid_stream_fails_only_its_request(pd, server):
    prefill, decodes, proxy = pd
    stream = _client(proxy).completions.create(model=MODEL, prompt=PROMPT + " we ask", max_tokens=400,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    running = [d for d in decodes if metric(d, "vllm:num_requests_running") == 1]
    assert len(running) == 1
    running[0].proc.kill()
    running[0].proc.wait()
    with pytest.raises(openai.APIError, match=r"request pd-\w+: the decode instance .* failed while streaming"):
        for _ in stream:
            pass
    kwargs = dict(model=MODEL, prompt=PROMPT + " the emperors", max_tokens=12, temperature=0)
    for _ in range(2):   # the next requests go to the live decode instance, whichever the proxy tries first
        got = _client(proxy).completions.create(**kwargs).choices[0].text
        assert got == _client(server).completions.create(**kwargs).choices[0].text


def test_without_its_prefill_instance_the_decode_instance_computes_the_prompt(pd, server):
    prefill, decodes, proxy = pd
    prefill.proc.kill()
    prefill.proc.wait()
    before = _loaded(decodes)
    kwargs = dict(model=MODEL, prompt="A different prompt about the sea, the sky and the birds between them, "
                  "and the fishermen who", max_tokens=12, temperature=0)
    assert (_client(proxy).completions.create(**kwargs).choices[0].text
            == _client(server).completions.create(**kwargs).choices[0].text)
    assert _loaded(decodes) == before
