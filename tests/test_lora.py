"""Multi-LoRA: greedy output and logprobs equal transformers + peft with the same adapters; a batch mixing the base
and several adapters equals each request alone, through chunked prefill, preemption, prefix caching, n > 1,
speculative decoding, adapter eviction and background reloads; the fused C++ stack equals the modules bit for
bit; bad adapters are refused with a clear error while the engine keeps serving; the HTTP routes."""
from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import numpy as np
import pytest
import torch

from kvserve import LLM, LoRAError, LoRARequest, SamplingParams
from kvserve.attention import bind_kv_cache, single_sequence_metadata
from kvserve.lora.layers import LoRAMapping, LoRAWeights
from model_utils import save_tiny_model
from tokenizer_utils import load_smollm2_tokenizer

PROMPTS = [[1, 17, 33, 90, 5, 61], [1, 200, 4, 4, 18], [1, 7, 150, 99, 23, 45, 12, 8, 3], [1, 250, 66]]
GREEDY = SamplingParams(max_tokens=10, temperature=0, logprobs=1)
# (targets, rank, extra LoraConfig fields): several ranks, target sets and scalings
ADAPTERS = {
    "qvd": (["q_proj", "v_proj", "down_proj"], 4, {}),
    "all": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 8, {"use_rslora": True}),
    "kogu": (["k_proj", "o_proj", "gate_proj", "up_proj"], 2, {"alpha_pattern": {"o_proj": 7.0},
                                                                "rank_pattern": {"gate_proj": 5}}),
}


def save_adapter(base_dir, out_dir, targets, rank, seed, **extra):
    """A PEFT LoRA adapter on the checkpoint at base_dir with random non-zero A and B, saved to out_dir; returns the
    peft model (float32, eval) as the reference."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0,
                                            **extra))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(str(out_dir))
    return model.eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Llama (the SmolLM2 tokenizer beside it), and its adapters with their peft references."""
    root = tmp_path_factory.mktemp("lora")
    save_tiny_model("llama", root / "base")
    load_smollm2_tokenizer().save_pretrained(str(root / "base"))
    refs, requests = {}, {}
    for i, (name, (targets, rank, extra)) in enumerate(ADAPTERS.items()):
        refs[name] = save_adapter(root / "base", root / name, targets, rank, seed=i + 1, **extra)
        requests[name] = LoRARequest(name, i + 1, str(root / name))
    return root, refs, requests


def peft_greedy(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """transformers + peft greedy tokens and their logprobs (attention mask passed explicitly)."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)]
    return tokens, logprobs


@pytest.fixture(scope="module")
def expected(models):
    """Per adapter (None: the base model) the reference tokens and logprobs of every prompt."""
    _, refs, _ = models
    want = {name: [peft_greedy(ref, p, GREEDY.max_tokens) for p in PROMPTS] for name, ref in refs.items()}
    ref = refs["qvd"]
    with ref.disable_adapter():
        want[None] = [peft_greedy(ref, p, GREEDY.max_tokens) for p in PROMPTS]
    return want


@pytest.fixture(scope="module")
def llm(models):
    root, _, _ = models
    return LLM(str(root / "base"), dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=8, num_kv_blocks=64)


def run(llm, loras, prompts=PROMPTS, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    return [(o.outputs[0].token_ids, [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs])
            for o in outs]


def assert_matches(got, want):
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        np.testing.assert_allclose(logprobs, want_logprobs, atol=2e-4)


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_greedy_and_logprobs_equal_peft(llm, models, expected, name):
    _, _, requests = models
    assert expected[name] != expected[None]   # the adapter changes the output: the comparison means something
    assert_matches(run(llm, requests[name]), expected[name])


def test_the_torch_path_equals_peft_too(models, expected):
    """Without the C++ kernels (and off the CPU) the modules apply adapters in torch ops: the same outputs."""
    from kvserve import kernels
    root, _, requests = models
    with kernels.variant("none"):
        llm = LLM(str(root / "base"), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
                  num_kv_blocks=64)
        got = run(llm, [requests["all"], None, requests["kogu"], requests["all"]])
    assert_matches(got, [expected["all"][0], expected[None][1], expected["kogu"][2], expected["all"][3]])


def test_one_batch_mixes_the_base_and_three_adapters(llm, models, expected):
    _, _, requests = models
    names = [None, "qvd", "all", "kogu", "all", None, "qvd", "kogu"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    got = run(llm, [requests[n] if n else None for n in names], prompts)
    assert_matches(got, [expected[n][i % len(PROMPTS)] for i, n in enumerate(names)])


def test_composes_with_chunking_preemption_caching_n_and_speculation(models, expected):
    """Two slots and two adapters in memory for three adapters: capacity waits and slot reuse (the adapters of the
    requests in flight stay in memory beyond max_cpu_loras); an 8-token step budget chunks every prompt; 12 blocks
    force preemption; the prefix cache is on and each (adapter, prompt) runs twice; n = 2; n-gram speculation
    verifies drafts with the adapter."""
    root, _, requests = models
    llm = LLM(str(root / "base"), dtype="float32", enable_lora=True, max_loras=2, max_cpu_loras=2,
              max_lora_rank=8, num_kv_blocks=12, block_size=4, max_num_batched_tokens=8,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    names = ["all", None, "qvd", "kogu"] * 2   # each (adapter, prompt) twice: the second may hit the cache
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=1, n=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=[requests[n] if n else None for n in names])
    for i, (out, name) in enumerate(zip(outs, names)):
        want_tokens, want_logprobs = expected[name][i % len(PROMPTS)]
        for o in out.outputs:
            assert o.token_ids == want_tokens
            np.testing.assert_allclose([next(iter(lp.values())).logprob for lp in o.logprobs], want_logprobs,
                                       atol=2e-4)
    sched, lora = llm.llm_engine.scheduler, llm.llm_engine.lora
    assert sched.num_preemptions > 0 and sched.prefix_cache_hits > 0 and sched.spec_stats.num_drafts > 0
    assert lora.num_slot_writes >= 3 > lora.max_loras and lora.num_loads == 3   # slots reused; no reloads


def test_an_adapter_saved_as_a_torch_pickle_loads_the_same(llm, models, expected, tmp_path):
    """adapter_model.bin (older PEFT) holds the same tensors as adapter_model.safetensors."""
    from safetensors.torch import load_file
    _, _, requests = models
    source = requests["qvd"].lora_path
    (tmp_path / "adapter_config.json").write_text(open(f"{source}/adapter_config.json").read())
    torch.save(load_file(f"{source}/adapter_model.safetensors"), tmp_path / "adapter_model.bin")
    assert_matches(run(llm, LoRARequest("qvd-bin", 60, str(tmp_path)), PROMPTS[:2]), expected["qvd"][:2])


def test_structured_output_with_an_adapter(llm, models):
    _, _, requests = models
    params = SamplingParams(max_tokens=6, temperature=0, structured_outputs={"choice": ["yes", "no"]})
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False, lora_request=requests["all"])
    assert out[0].outputs[0].text in ("yes", "no")


def write_adapter(path, config: dict, tensors: dict[str, torch.Tensor]):
    from safetensors.torch import save_file
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, **config}))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def lora_pair(module: str, rank: int = 4, inputs: int = 64, outputs: int = 64, layer: int = 0) -> dict:
    block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    stem = f"base_model.model.model.layers.{layer}.{block}.{module}"
    return {f"{stem}.lora_A.weight": torch.randn(rank, inputs), f"{stem}.lora_B.weight": torch.randn(outputs, rank)}


BAD_ADAPTERS = {
    "no directory": (None, "is not a directory"),
    "no config": ("noconfig", "no adapter_config.json"),
    "corrupt weights": ("corrupt", "not a valid safetensors file"),
    "DoRA": ({"use_dora": True}, "DoRA"),
    "output head": ({}, "embeddings or the output head"),
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, "saves whole modules"),
    "rank over the limit": ({"r": 16}, "more than max_lora_rank=8"),
    "another base model": ({"base_model_name_or_path": "big-model"}, "does not fit this base model"),
    "trained biases": ({"bias": "all"}, "trains biases"),
    "missing B": ({}, "has no lora_B"),
    "NaN weights": ({}, "NaN"),
}


def make_bad_adapter(root, kind: str):
    path = root / kind.replace(" ", "_")
    config, _ = BAD_ADAPTERS[kind]
    good = lora_pair("q_proj")
    if kind == "no directory":
        return path
    if kind == "no config":
        path.mkdir()
        return path
    if kind == "corrupt weights":
        write_adapter(path, {}, good)
        (path / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
        return path
    tensors = good
    if kind == "output head":
        tensors = {**good, "base_model.model.lm_head.lora_A.weight": torch.randn(4, 64),
                   "base_model.model.lm_head.lora_B.weight": torch.randn(256, 4)}
    elif kind == "rank over the limit":
        tensors = lora_pair("q_proj", rank=16)
    elif kind == "another base model":
        tensors = lora_pair("q_proj", inputs=128)
    elif kind == "missing B":
        tensors = {k: v for k, v in good.items() if "lora_A" in k}
    elif kind == "NaN weights":
        tensors = {k: torch.full_like(v, float("nan")) for k, v in good.items()}
    return write_adapter(path, config, tensors)


@pytest.mark.parametrize("kind", list(BAD_ADAPTERS))
def test_bad_adapters_are_refused_and_the_engine_keeps_serving(llm, models, expected, tmp_path, kind):
    _, _, requests = models
    bad = LoRARequest(f"bad-{kind}", 100 + list(BAD_ADAPTERS).index(kind), str(make_bad_adapter(tmp_path, kind)))
    with pytest.raises(LoRAError, match=BAD_ADAPTERS[kind][1]):
        run(llm, [requests["qvd"], bad], PROMPTS[:2])
    assert not llm.llm_engine.has_unfinished_requests()   # all or nothing: the good prompt was withdrawn
    assert_matches(run(llm, requests["qvd"], PROMPTS[:1]), expected["qvd"][:1])


def test_misuse_is_a_typed_error(llm, models, tmp_path):
    root, _, requests = models
    with pytest.raises(LoRAError, match="already names the adapter 'qvd'"):
        run(llm, LoRARequest("other", requests["qvd"].lora_int_id, requests["all"].lora_path))
    with pytest.raises(LoRAError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("x", 0, "/tmp")
    with pytest.raises(LoRAError, match="start the engine with enable_lora=True"):
        run(LLM(str(root / "base"), dtype="float32", num_kv_blocks=16), requests["qvd"])
    with pytest.raises(Exception, match="max_cpu_loras .* must be at least max_loras"):
        LLM(str(root / "base"), enable_lora=True, max_loras=4, max_cpu_loras=2)


def test_an_adapter_that_disappears_fails_its_request_only(models, expected, tmp_path):
    """Evicted from memory, reloaded on the loading thread, evicted again, then deleted: the next reload fails
    that request with the reason; the others in the same steps finish."""
    root, _, requests = models
    gone = LoRARequest("gone", 50, str(shutil.copytree(root / "qvd", tmp_path / "gone")))
    llm = LLM(str(root / "base"), dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=1,
              max_lora_rank=8, num_kv_blocks=64)
    engine = llm.llm_engine

    def run_both(first, second):
        engine.add_request("a", {"prompt_token_ids": PROMPTS[0]}, GREEDY, lora_request=first)
        engine.add_request("b", {"prompt_token_ids": PROMPTS[1]}, GREEDY, lora_request=second)
        done = {}
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        return done, engine.take_failed_requests()

    done, failed = run_both(gone, requests["all"])   # "gone" loads at add, then "all" evicts it from memory
    assert not failed and done["a"].outputs[0].token_ids == expected["qvd"][0][0]
    loads = engine.lora.num_loads
    done, failed = run_both(requests["all"], gone)   # reloaded in the background while "all" runs
    assert not failed and done["b"].outputs[0].token_ids == expected["qvd"][1][0]
    assert engine.lora.num_loads == loads + 1
    run(llm, requests["all"], PROMPTS[:1])           # evicts it again
    shutil.rmtree(tmp_path / "gone")
    done, failed = run_both(gone, requests["all"])
    assert list(failed) == ["a"] and "not a directory" in str(failed["a"])
    assert done["b"].outputs[0].token_ids == expected["all"][1][0]
    assert not engine.lora._refs   # every request in flight unpinned its adapter


def test_the_kernel_equals_torch_and_leaves_base_rows_alone():
    from kvserve import kernels
    if kernels.load() is None:
        pytest.skip("no C++ kernels: apply() is apply_torch()")
    torch.manual_seed(0)
    mapping = LoRAMapping()
    table = LoRAWeights(48, [40, 24], max_loras=3, max_rank=8, mapping=mapping, device=torch.device("cpu"))
    table.set_slot(0, 0, torch.randn(8, 48), torch.randn(40, 8))
    table.set_slot(0, 1, torch.randn(3, 48), torch.randn(24, 3))
    table.set_slot(2, 1, torch.randn(5, 48), torch.randn(24, 5))   # slot 2 leaves shard 0 alone
    rows = np.array([2, -1, 0, 0, 2, -1, 1], np.int32)              # slot 1 is empty
    mapping.set(rows, torch.device("cpu"))
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        x, y = torch.randn(len(rows), 48, dtype=dtype), torch.randn(len(rows), 64, dtype=dtype)
        got, want = y.clone(), y.clone()
        table.apply(x, got)
        table.apply_torch(x, want)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        untouched = (rows == -1) | (rows == 1)
        assert torch.equal(got[untouched], y[untouched])       # base rows and the empty slot's row
        assert torch.equal(got[4, :40], y[4, :40])            # slot 2's untouched shard
        assert not torch.equal(got[2], y[2]) and not torch.equal(got[4, 40:], y[4, 40:])


def test_adapter_tables_are_float32_whatever_the_default_dtype():
    """torch's default dtype is process-wide, and a model loading in bf16 in another thread changes it: the tables
    the kernel reads as float32 must not follow it."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        table = LoRAWeights(48, [40, 24], max_loras=2, max_rank=8, mapping=LoRAMapping(), device=torch.device("cpu"))
    finally:
        torch.set_default_dtype(previous)
    assert table.a.dtype == table.bt.dtype == torch.float32


def test_fused_stack_equals_the_modules_bit_for_bit(tmp_path, monkeypatch):
    """The fused C++ stack applies the same LoRA kernel on the same tables as the modules: one step mixing base
    and adapter rows, and a decode batch the stack splits between threads, bit-identical (every linear int8, so
    the stack runs on AVX2 CPUs too)."""
    from kvserve import kernels
    from kvserve.lora.manager import LoRAManager
    import test_fused_layers as fused_tests
    from test_quantization import load
    lib = kernels.load()
    if lib is None:
        pytest.skip("no C++ kernels")
    save_tiny_model("qwen2", tmp_path / "base", hidden_size=128, intermediate_size=96)
    model = load(str(tmp_path / "base"), "int8", dtype="bfloat16")
    model.prepack()
    if not lib.silu_mul_fast:
        pytest.skip("the fused stack needs AVX2 or AVX-512 BF16")
    manager = LoRAManager(model, max_loras=2, max_lora_rank=8, max_cpu_loras=2)
    for slot, (targets, rank) in enumerate(((["q_proj", "v_proj", "down_proj"], 8), (list(
            ("q_proj", "k_proj", "o_proj", "gate_proj", "up_proj")), 3))):
        for layer in range(2):
            for module in targets:
                name, shard = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                               "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0),
                               "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}[module]
                k, n = manager.shapes[(name, shard)]
                manager.tables[(layer, name)].set_slot(slot, shard, torch.randn(rank, k) * 0.3,
                                                       torch.randn(n, rank) * 0.3)
    # the checks run their steps through model(...): the mapping marks rows by their position in the step
    real_forward = type(model.model).forward
    calls = []

    def forward(self, input_ids, positions, meta):
        rows = np.array([(-1, 0, 1)[int(p) % 3] for p in positions], np.int32)
        manager.mapping.set(rows, torch.device("cpu"))
        calls.append(len(rows))
        try:
            return real_forward(self, input_ids, positions, meta)
        finally:
            manager.mapping.clear()
    monkeypatch.setattr(type(model.model), "__call__", forward)   # InferenceModule calls go straight to forward
    ids, meta = torch.arange(3, 12), single_sequence_metadata(9)
    bind_kv_cache(model, 4, 16, torch.bfloat16)
    with torch.inference_mode():
        adapted = model(ids, torch.arange(9), meta)
        plain = real_forward(model.model, ids, torch.arange(9), meta)
    assert not torch.equal(adapted, plain)   # the adapters change what the stack computes
    fused_tests.check_quantized_stack(model)
    assert model.model._fused is not None and model.model._fused.has_lora and calls


def test_lora_modules_flag_parsing():
    from kvserve.entrypoints.cli import parse_lora_modules
    from kvserve.errors import KVServeError
    assert parse_lora_modules(["sql=/a", '{"name": "chat", "path": "/b", "base_model_name": "m"}']) == [
        ("sql", "/a", None), ("chat", "/b", "m")]
    for bad in (["nopath"], ["x=/a", "x=/b"], ['{"name": 1}'], ["{oops"]):
        with pytest.raises(KVServeError, match="--lora-modules"):
            parse_lora_modules(bad)


def offline_text(engine, prompt, lora, want_ids) -> str:
    """The text the engine generates for `prompt` with `lora`, after checking its tokens are `want_ids`."""
    engine.add_request("offline", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=10, temperature=0),
                       lora_request=lora)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert outs[0].outputs[0].token_ids == want_ids
    return outs[0].outputs[0].text


def test_http_adapters_as_models_runtime_loading_and_metrics(models, expected, tmp_path):
    """The OpenAI routes in-process: a served adapter by its model name, /v1/models with parents, runtime load and
    unload behind the API key, 400/404 for bad adapters and names, and vllm:lora_requests_info."""
    from kvserve.config import EngineConfig
    from kvserve.engine.async_engine import AsyncLLMEngine
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.entrypoints.openai.api_server import ServerSettings, build_app
    root, _, requests = models
    llm = LLMEngine(EngineConfig(model=str(root / "base"), dtype="float32", enable_lora=True, max_loras=2,
                                 max_lora_rank=8, num_kv_blocks=64))
    want = {name: offline_text(llm, prompt, requests.get(name), expected[name][i][0])
            for name, i, prompt in ((None, 0, PROMPTS[0]), ("qvd", 0, PROMPTS[0]), ("all", 1, PROMPTS[1]))}
    llm.lora.register(LoRARequest("sql", llm.lora.next_id(), requests["qvd"].lora_path, base_model_name="base"))
    bad_dir = make_bad_adapter(tmp_path, "DoRA")
    key = {"Authorization": "Bearer k"}

    async def main():
        engine = AsyncLLMEngine(llm)
        app = build_app(engine, ServerSettings(served_model_names=["base"], api_key="k",
                                               enable_runtime_lora_updating=True))
        engine.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://m",
                                         headers=key) as http:
                await scenario(http)
        finally:
            await engine.stop()

    async def complete(http, model, prompt=PROMPTS[0]):
        return await http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 10,
                                                         "temperature": 0})

    async def scenario(http):
        models_list = (await http.get("/v1/models")).json()["data"]
        assert [(m["id"], m["parent"]) for m in models_list] == [("base", None), ("sql", "base")]
        base, sql = await asyncio.gather(complete(http, "base"), complete(http, "sql"))
        assert base.status_code == sql.status_code == 200
        text = lambda r: r.json()["choices"][0]["text"]
        assert text(sql) == want["qvd"] and text(base) == want[None] and want["qvd"] != want[None]
        # runtime loading, guarded by the key
        body = {"lora_name": "chat", "lora_path": requests["all"].lora_path}
        assert (await http.post("/v1/load_lora_adapter", json=body, headers={"Authorization": ""})).status_code == 401
        r = await http.post("/v1/load_lora_adapter", json=body)
        assert r.status_code == 200 and "chat" in r.text
        assert text(await complete(http, "chat", PROMPTS[1])) == want["all"]
        for payload, status, words in (({"lora_name": "chat", "lora_path": requests["all"].lora_path}, 400,
                                        "already loaded"),
                                       ({"lora_name": "dora", "lora_path": str(bad_dir)}, 400, "DoRA"),
                                       ({"lora_name": "base", "lora_path": requests["all"].lora_path}, 400,
                                        "base model's name"),
                                       ({"lora_name": "x"}, 400, "lora_path")):
            r = await http.post("/v1/load_lora_adapter", json=payload)
            assert r.status_code == status and words in r.json()["error"]["message"], r.text
        metrics = (await http.get("/metrics")).text
        assert 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in metrics
        r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
        assert r.status_code == 200
        r = await complete(http, "chat")
        assert r.status_code == 404 and "'sql'" in r.json()["error"]["message"]
        assert (await http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})).status_code == 404
        assert [m["id"] for m in (await http.get("/v1/models")).json()["data"]] == ["base", "sql"]
    asyncio.run(main())


def test_an_adapter_on_gemma3_equals_peft(tmp_path):
    """A family declared beside Llama's (sandwich norms, windows shorter than the outputs, GeGLU): the adapters
    attach to the same roles."""
    save_tiny_model("gemma3", tmp_path / "base")
    load_smollm2_tokenizer().save_pretrained(str(tmp_path / "base"))
    targets, rank, extra = ADAPTERS["all"]
    ref = save_adapter(tmp_path / "base", tmp_path / "all", targets, rank, seed=5, **extra)
    want = [peft_greedy(ref, p, GREEDY.max_tokens) for p in PROMPTS]
    with ref.disable_adapter():
        assert want != [peft_greedy(ref, p, GREEDY.max_tokens) for p in PROMPTS]
    llm = LLM(str(tmp_path / "base"), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
              num_kv_blocks=64)
    assert_matches(run(llm, LoRARequest("all", 1, str(tmp_path / "all"))), want)
