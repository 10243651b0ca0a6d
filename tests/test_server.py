"""The OpenAI-compatible server, end to end: a real `kvserve serve` process driven by the official openai client.

One server process (bundled model, float32, a small KV cache; conftest.py) serves this module and
tests/test_server_errors.py. The greedy references come from LLM.generate on the same weights, so "the right
tokens" means "what the offline engine produces".
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import openai
import pytest

from kvserve import SamplingParams
from server_utils import API_KEY, MAX_MODEL_LEN, MODEL, metric, post, wait_idle

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


@pytest.fixture(scope="session")
def llm():
    from kvserve import LLM
    return LLM(dtype="float32", kv_cache_memory="48MiB", max_model_len=MAX_MODEL_LEN)


def greedy(llm, prompts: list[str], max_tokens: list[int]) -> list[str]:
    params = [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens]
    return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]


def sse_events(server, path: str, body: dict) -> list[str]:
    """The raw `data:` payloads of a streamed response, in order."""
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]


# ----- plain endpoints -----
def test_health_version_models(server, client):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_tokenize_detokenize(server, llm):
    ids = post(server, "/tokenize", {"prompt": PROMPT}).json()
    assert ids["tokens"] == llm.get_tokenizer().encode(PROMPT) and ids["count"] == len(ids["tokens"])
    assert ids["max_model_len"] == MAX_MODEL_LEN
    assert post(server, "/detokenize", {"tokens": ids["tokens"]}).json()["prompt"] == PROMPT
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["tokens"] == llm.apply_chat_template([{"role": "user", "content": "Hi"}])


def test_metrics_have_vllm_names(server):
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:request_success_total"):
        assert f"{name}{{" in text or f"# TYPE {name.removesuffix('_bucket')}" in text, name
    assert f'model_name="{MODEL}"' in text


def test_reset_prefix_cache(server):
    wait_idle(server)
    assert post(server, "/reset_prefix_cache", {}).status_code == 200


# ----- completions -----
def test_greedy_completion_equals_llm_generate(client, llm):
    prompts = [PROMPT, "def fibonacci(n):", "Once upon a time"]
    expected = greedy(llm, prompts, [12] * 3)
    for prompt, want in zip(prompts, expected):
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert got.choices[0].text == want
        assert got.choices[0].finish_reason in ("length", "stop")


def test_completion_usage_and_cached_tokens(server, client, llm):
    prompt = "Paged attention stores the KV cache in fixed-size blocks, so that memory is not wasted. " * 2
    num_prompt = len(llm.get_tokenizer().encode(prompt))
    cached_before = metric(server, "vllm:prompt_tokens_cached_total")
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    for r in (first, second):
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
            (num_prompt, 5, num_prompt + 5)
    # the second request finds the first one's full blocks in the prefix cache
    assert second.usage.prompt_tokens_details.cached_tokens == (num_prompt - 1) // 16 * 16 > 0
    wait_idle(server)
    assert metric(server, "vllm:prompt_tokens_cached_total") - cached_before == \
        second.usage.prompt_tokens_details.cached_tokens


def test_streaming_completion_matches_and_ends_with_done(server, client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    events = sse_events(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 10, "temperature": 0,
                                                    "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole.choices[0].text
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


def test_streamed_logprobs_with_echo(server):
    events = sse_events(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                                    "logprobs": 2, "echo": True, "stream": True})
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    tokens = [t for c in chunks for t in c["logprobs"]["tokens"]]
    assert "".join(tokens) == "".join(c["text"] for c in chunks) and chunks[0]["text"].startswith(PROMPT)
    offsets = [o for c in chunks for o in c["logprobs"]["text_offset"]]
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


def test_n_and_list_prompts(client, llm):
    tok = llm.get_tokenizer()
    r = client.completions.create(model=MODEL, prompt=["Hello", "Good morning"], n=2, max_tokens=4, temperature=0.8,
                                  seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == len(tok.encode("Hello")) + len(tok.encode("Good morning"))
    assert r.usage.completion_tokens == 2 * 2 * 4
    ids = [tok.encode(PROMPT), tok.encode("Hello")]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=3, temperature=0)
    assert [c.text for c in by_ids.choices] == [c.text for c in by_text.choices]
    assert by_ids.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    single = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=3, temperature=0)
    assert single.choices[0].text == by_text.choices[0].text


def test_seed_reproducibility(client):
    def sample(seed):
        r = client.completions.create(model=MODEL, prompt="My favourite colour is", max_tokens=12, temperature=1.0,
                                      seed=seed, n=2)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert sample(1234) == sample(1234)


def test_logprobs_and_echo(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens == 4
    assert "".join(lp.tokens) == r.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 3 <= len(top) <= 4
        assert top[token] == pytest.approx(max(top.values()))   # greedy picks the most likely token
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1,
                                       echo=True)
    assert echoed.choices[0].text == PROMPT + r.choices[0].text
    elp = echoed.choices[0].logprobs
    assert elp.token_logprobs[0] is None and len(elp.tokens) == echoed.usage.prompt_tokens + 4
    assert elp.text_offset[-4] == len(PROMPT)


def test_stop_strings(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0).choices[0].text
    word = full.split()[1]
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stop=[word])
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == full[:full.index(word)]
    kept = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stop=word,
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == full[:full.index(word) + len(word)]


def test_logit_bias(client, llm):
    token = llm.get_tokenizer().encode(" banana")[0]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                  logit_bias={str(token): 100})
    assert r.choices[0].text == llm.get_tokenizer().decode([token] * 3)


def test_request_id_field_and_header(server):
    r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "request_id": "abc123"})
    assert r.json()["id"] == "cmpl-abc123" and r.headers["x-request-id"] == "cmpl-abc123"


# ----- chat -----
def test_chat_greedy_equals_llm_chat_and_streams_the_same(server, client, llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ref = llm.chat(messages, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    want = ref.outputs[0].text
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=12, temperature=0)
    assert whole.choices[0].message.content == want and whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert whole.usage.prompt_tokens == len(ref.prompt_token_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=12,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    events = sse_events(server, "/v1/chat/completions", {"messages": messages, "max_completion_tokens": 12,
                                                         "temperature": 0, "stream": True})
    assert events[-1] == "[DONE]" and all(json.loads(e)["object"] == "chat.completion.chunk" for e in events[:-1])


def test_chat_template_per_request(client, llm):
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                       extra_body={"chat_template": template})
    assert r.usage.prompt_tokens == len(llm.get_tokenizer().encode("user: Hi\nassistant:"))


def test_chat_logprobs_and_n(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=2, n=2)
    assert len(r.choices) == 2 and r.choices[0].message.content == r.choices[1].message.content
    for entry in r.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
        assert entry.bytes == list(entry.token.encode())


def test_bench_serve_surface(server):
    """What `vllm bench serve` sends: ignore_eos, max_completion_tokens on chat, streaming with usage."""
    for path, body in (("/v1/completions", {"prompt": "Hi", "max_tokens": 7, "repetition_penalty": 1.0,
                                            "logprobs": None}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": [{"type": "text", "text": "Hi"}]}],
                                                 "max_completion_tokens": 7})):
        events = sse_events(server, path, {**body, "model": MODEL, "ignore_eos": True, "temperature": 0,
                                           "stream": True, "stream_options": {"include_usage": True}})
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 7
        chunks = [json.loads(e) for e in events[:-2]]
        assert len(chunks) >= 7 and all(c["choices"] for c in chunks)


# ----- concurrency, disconnects -----
TOPICS = ["the sea", "a cat", "mountains", "coffee", "the moon", "trains", "music", "winter", "a garden", "robots",
          "bread", "the desert", "a library", "rain", "football", "a volcano"]


def test_64_concurrent_streams_get_their_own_tokens(server, llm):
    prompts = [f"{'Please ' * (i % 4)}Write one sentence about {TOPICS[i % 16]}." for i in range(64)]
    max_tokens = [2 + (i * 5) % 11 for i in range(64)]
    expected = greedy(llm, prompts, max_tokens)
    aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)

    async def one(prompt: str, m: int) -> tuple[str, int]:
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=m, temperature=0,
                                                  stream=True, stream_options={"include_usage": True})
        text, usage = [], None
        async for chunk in stream:
            text += [c.text for c in chunk.choices]
            usage = chunk.usage or usage
        return "".join(text), usage.completion_tokens

    async def run_all():
        try:
            return await asyncio.gather(*(one(p, m) for p, m in zip(prompts, max_tokens)))
        finally:
            await aclient.close()

    results = asyncio.run(run_all())
    assert [text for text, _ in results] == expected
    assert all(n <= m for (_, n), m in zip(results, max_tokens))
    wait_idle(server)


def test_disconnect_mid_stream_frees_blocks(server):
    wait_idle(server)
    aborted = num_aborted(server)
    body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        lines = r.iter_lines()
        for _ in range(3):
            while not next(lines).startswith("data: "):
                pass
        assert metric(server, "vllm:kv_cache_usage_perc") > 0
    wait_idle(server, timeout_s=5)
    assert num_aborted(server) == aborted + 1


def test_disconnect_while_waiting_for_a_whole_response_frees_blocks(server):
    wait_idle(server)
    aborted = num_aborted(server)
    body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):   # the client gives up and closes the connection
        httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                   timeout=httpx.Timeout(60, read=1.5))
    wait_idle(server, timeout_s=5)
    assert num_aborted(server) == aborted + 1


def num_aborted(server) -> float:
    try:
        return metric(server, "vllm:request_success_total", finished_reason="abort")
    except KeyError:
        return 0.0


def _bench_serve(server, tmp_path, *flags: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "kvserve", "bench", "serve", "--base-url", server.url,
                           "--api-key", API_KEY, "--output-json", str(out), *flags],
                          capture_output=True, text=True, timeout=300)
    return proc, json.loads(out.read_text()) if out.exists() else None


def test_bench_serve_client_measures_the_random_workload(server, tmp_path):
    """`kvserve bench serve` sends every request of the seeded random workload (token-id prompts of exactly their
    input lengths, ignore_eos) and counts what the server streamed back."""
    from kvserve.entrypoints.bench import _special_ids, random_workload
    from kvserve.model.tokenizer import load_tokenizer
    wait_idle(server)
    counted = [metric(server, f"vllm:{name}_tokens_total") for name in ("prompt", "generation")]
    proc, got = _bench_serve(server, tmp_path, "--num-prompts", "6", "--input-len", "8:24", "--output-len", "4:9",
                             "--max-concurrency", "3", "--seed", "123")
    assert proc.returncode == 0, proc.stderr
    # the client's counts are the server's
    assert got["total_input_tokens"] == metric(server, "vllm:prompt_tokens_total") - counted[0]
    assert got["total_output_tokens"] == metric(server, "vllm:generation_tokens_total") - counted[1]
    tok = load_tokenizer(None)
    work = random_workload(6, (8, 24), (4, 9), 123, len(tok), _special_ids(tok))
    assert got["model_id"] == MODEL and got["completed"] == 6 and got["failed"] == 0
    assert got["total_input_tokens"] == sum(len(w["prompt_token_ids"]) for w in work)
    assert got["total_output_tokens"] == sum(w["output_len"] for w in work)
    assert 0 < got["mean_ttft_ms"] < got["mean_e2el_ms"] and got["mean_tpot_ms"] > 0
    assert got["output_throughput"] == pytest.approx(got["total_output_tokens"] / got["duration"])
    assert "Output token throughput (tok/s):" in proc.stdout


def test_bench_throughput_saves_the_workload_it_ran(tmp_path):
    """`kvserve bench throughput --save-workload` writes the token ids and output lengths it ran, for a peer
    (benchmarks/quantization.py --vllm) to run the same requests."""
    from kvserve.entrypoints.bench import _special_ids, random_workload
    from kvserve.model.tokenizer import load_tokenizer
    work_file, out = tmp_path / "work.json", tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "-m", "kvserve", "bench", "throughput", "--num-prompts", "3",
                           "--input-len", "8:16", "--output-len", "2:4", "--seed", "5", "--no-tqdm",
                           "--save-workload", str(work_file), "--output-json", str(out)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    saved, got = json.loads(work_file.read_text()), json.loads(out.read_text())
    tok = load_tokenizer(None)
    assert saved == random_workload(3, (8, 16), (2, 4), 5, len(tok), _special_ids(tok))
    assert got["num_input_tokens"] == sum(len(w["prompt_token_ids"]) for w in saved)
    assert got["num_output_tokens"] == sum(w["output_len"] for w in saved)


def test_bench_serve_client_reports_the_servers_rejection_and_bad_flags(server, tmp_path):
    # in this process: `kvserve bench serve`'s main, as the command line calls it (a process each costs seconds)
    from kvserve.entrypoints.bench import main as bench_main
    wait_idle(server)
    out = tmp_path / "bench.json"
    flags = ["serve", "--base-url", server.url, "--api-key", API_KEY, "--output-json", str(out)]
    with pytest.raises(SystemExit, match="every request failed; first error: HTTP 400: this model's maximum "
                                         "context length is 512"):
        bench_main([*flags, "--num-prompts", "2", "--input-len", "8", "--output-len", str(MAX_MODEL_LEN + 10)])
    got = json.loads(out.read_text())
    assert got["completed"] == 0 and got["failed"] == 2
    with pytest.raises(SystemExit, match="--max-concurrency must be >= 1"):
        bench_main([*flags, "--max-concurrency", "0"])
    with pytest.raises(SystemExit, match="cannot reach http://127.0.0.1:1/v1/models"):
        bench_main(["serve", "--base-url", "http://127.0.0.1:1"])
