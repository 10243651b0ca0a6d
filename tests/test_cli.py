"""The `kvserve` command line as a user runs it: generate, chat, serve's shutdown on a signal, and the errors (in
processes of their own; the further generate and chat runs through the same entry point, cli.main, in this one)."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from kvserve import SamplingParams, kernels
from kvserve.entrypoints import cli
from server_utils import ServerProcess

pytestmark = pytest.mark.slow

ENGINE_FLAGS = ["--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "1024"]
PROMPT = "The capital of France is"


def kvserve(*args: str, stdin: str | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvserve", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.fixture
def kvserve_here(capfd, monkeypatch):
    """`kvserve ARGS` run by the entry point in this process (cli.main, what `kvserve` calls), as a
    CompletedProcess: the commands past the first subprocess test, without a process's imports each. capfd: what
    any code writes to the file descriptors, as the process's output would hold it."""
    def run(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
        capfd.readouterr()
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        status = cli.main(list(args))
        out, err = capfd.readouterr()
        return subprocess.CompletedProcess(["kvserve", *args], status, out, err)
    return run


@pytest.fixture(scope="module")
def llm():
    from kvserve import LLM
    return LLM(dtype="float32", kv_cache_memory="64MiB", max_model_len=1024)


def test_help_lists_every_subcommand():
    out = kvserve("--help", timeout=60)
    assert out.returncode == 0
    for name in ("serve", "generate", "chat", "bench"):
        assert name in out.stdout
    serve_help = kvserve("serve", "--help", timeout=60).stdout
    for flag in ("--api-key", "--served-model-name", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
                 "--block-size", "--kv-cache-memory", "--dtype", "--seed", "--chat-template", "--max-waiting-requests",
                 "--log-format", "--no-enable-prefix-caching"):
        assert flag in serve_help, flag


def test_generate_prints_the_greedy_completion(llm):
    want = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0].text
    out = kvserve("generate", PROMPT, "--max-tokens", "8", "--temperature", "0", *ENGINE_FLAGS)
    assert out.returncode == 0, out.stderr
    assert out.stdout == want + "\n"


def test_generate_on_the_torch_attention_backend_prints_the_same_completion(llm, kvserve_here):
    """--attention-backend torch (the reference) against the default C++ kernels; --enforce-eager is accepted on the
    CPU, where every step is eager anyway."""
    want = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0].text
    out = kvserve_here("generate", PROMPT, "--max-tokens", "8", "--temperature", "0", "--attention-backend", "torch",
                       "--enforce-eager", *ENGINE_FLAGS)
    assert out.returncode == 0, out.stderr
    assert out.stdout == want + "\n"


def test_the_triton_backend_on_the_cpu_fails_with_a_clear_message():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}   # the tests' interpreter, not a user's
    out = subprocess.run([sys.executable, "-m", "kvserve", "generate", PROMPT, "--attention-backend", "triton",
                          "--device", "cpu", *ENGINE_FLAGS], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 1 and "attention_backend triton cannot run" in out.stderr, out.stderr
    assert "TRITON_INTERPRET" in out.stderr and "Traceback" not in out.stderr


def test_generate_with_speculative_decoding_prints_the_same_completion(llm, kvserve_here):
    prompt = "Repeat exactly: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat"
    want = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0].text
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4})
    out = kvserve_here("generate", prompt, "--max-tokens", "24", "--temperature", "0", "--speculative-config", spec,
                       *ENGINE_FLAGS)
    assert out.returncode == 0, out.stderr
    assert out.stdout == want + "\n"


def test_generate_follows_a_json_schema_or_a_choice(tmp_path, kvserve_here):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    prompt = "The capital of France as JSON:"
    out = kvserve_here("generate", prompt, "--max-tokens", "24", "--temperature", "0", "--json-schema", str(path),
                       *ENGINE_FLAGS)
    assert out.returncode == 0, out.stderr
    assert set(json.loads(out.stdout)) == {"city"}
    args = cli.build_parser().parse_args(["generate", prompt, "--choice", "Paris", "--choice", "Rome"])
    assert cli.sampling_params_from_args(args).structured_outputs.choice == ["Paris", "Rome"]


@pytest.mark.parametrize("flags, words", [
    (["--speculative-config", '{"method": "medusa", "num_speculative_tokens": 2}'], "unknown method 'medusa'"),
    (["--max-request-body-size", "0"], "--max-request-body-size must be positive"),
    (["--data-parallel-size", "2"], "add --distributed-executor-backend ray"),
    (["--enable-lora", "--lora-modules", "SmolLM2-135M-Instruct=/x"], "is the base model's name")])
def test_serve_with_a_bad_flag_fails_with_a_clear_message_before_importing_torch(flags, words, tmp_path):
    """Every flag is checked before the engine's imports: the error comes at once. The process finds a torch that
    fails to import: a check after the imports would fail on it instead."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('torch imported before the flags were checked')")
    out = subprocess.run([sys.executable, "-m", "kvserve", "serve", "--port", "0", *flags], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert out.returncode == 1 and words in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_chat_repl_streams_answers_and_keeps_the_conversation(llm, kvserve_here):
    params = SamplingParams(temperature=0, max_tokens=6)
    first = [{"role": "user", "content": "Hi"}]
    want1 = llm.chat(first, params, use_tqdm=False)[0].outputs[0].text
    second = first + [{"role": "assistant", "content": want1}, {"role": "user", "content": "Tell me a joke"}]
    want2 = llm.chat(second, params, use_tqdm=False)[0].outputs[0].text
    out = kvserve_here("chat", "--max-tokens", "6", "--temperature", "0", *ENGINE_FLAGS,
                       stdin="Hi\n\nTell me a joke\n/exit\nnever read\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"{want1}\n{want2}\n"


def test_serve_with_a_missing_model_fails_with_a_clear_message():
    out = kvserve("serve", "/no/such/model", "--port", "0", timeout=60)
    assert out.returncode == 1 and "/no/such/model" in out.stderr and "Traceback" not in out.stderr


def test_sigterm_lets_short_requests_finish_and_tells_long_ones_why_not(tmp_path):
    """Also serves a LoRA adapter given on the command line (one server start for both)."""
    adapter = _smollm2_adapter(tmp_path / "sql")
    server = ServerProcess("--log-format", "json", "--shutdown-timeout", "3", "--enable-lora", "--max-lora-rank",
                           "8", "--lora-modules", f"sql={adapter}", *ENGINE_FLAGS)
    proc, url, port = server.proc, server.url, server.port
    try:
        server.wait_ready()
        models = httpx.get(f"{url}/v1/models").json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [("SmolLM2-135M-Instruct", None),
                                                            ("sql", "SmolLM2-135M-Instruct")]
        body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        base, sql = (httpx.post(f"{url}/v1/completions", json={**body, "model": m}, timeout=60).json()
                     for m in ("SmolLM2-135M-Instruct", "sql"))
        assert sql["model"] == "sql" and sql["choices"][0]["text"] != base["choices"][0]["text"]
        short, long = {}, {}
        threads = [threading.Thread(target=_stream, args=(url, 15, short)),
                   threading.Thread(target=_stream, args=(url, 900, long))]
        for t in threads:
            t.start()
        while not (short.get("started") and long.get("started")):
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert proc.wait(60) == 0
    finally:
        proc.kill()
    assert short["events"][-1] == "[DONE]" and json.loads(short["events"][-2])["choices"][0]["finish_reason"]
    assert long["events"][-1] == "[DONE]"
    assert json.loads(long["events"][-2])["error"]["code"] == "server_shutting_down"
    lines = server.output().splitlines()
    assert any(line.startswith(f"kvserve: ready at http://127.0.0.1:{port}") for line in lines)
    expected = kernels.summary(torch.bfloat16 if "(bfloat16," in server.output() else torch.float32,
                               torch.device("cpu"))
    assert f"kernels: {expected}" in lines   # the ready message says which kernel paths run
    records = [json.loads(line) for line in lines if line.startswith("{")]
    access = [r for r in records if r["logger"] == "kvserve.access" and r["path"] == "/v1/completions"]
    assert len(access) == 4 and all(r["request_id"].startswith("cmpl-") and r["status"] == 200 for r in access)
    assert any(line.startswith("LoRA: 1 adapter of rank <= 8 per step") and line.endswith("adapters: sql")
               for line in lines)


def _smollm2_adapter(path):
    """A PEFT adapter for the bundled SmolLM2 (rank 4 on q_proj and down_proj of every layer), random weights."""
    from safetensors.torch import save_file
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(30):
        for module, k, n in (("self_attn.q_proj", 576, 576), ("mlp.down_proj", 1536, 576)):
            stem = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(4, k, generator=gen) / k ** 0.5
            tensors[f"{stem}.lora_B.weight"] = torch.randn(n, 4, generator=gen)
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    return path


def _stream(url: str, max_tokens: int, result: dict) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    result["events"] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                result["events"].append(line[len("data: "):])
                result["started"] = True
