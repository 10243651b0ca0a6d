"""The engine end to end on the Triton attention backend (attention_backend="triton"): on a CUDA machine natively,
elsewhere under Triton's interpreter on CPU tensors (conftest.py sets TRITON_INTERPRET=1). Tiny random models in
float32: greedy output token-identical to transformers' generate (attention_mask passed), and equal to the torch
reference backend with batching, chunked prefill, preemption, prefix caching and speculative decoding.

The tokenizer only names the special tokens here (prompts are token ids): the bundled model's GGUF, or the directory
KVSERVE_TEST_TOKENIZER names (the GPU check carries one: the GPU machine has no bundled model)."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.attention.triton import unavailable_reason  # noqa: E402
from kvserve.errors import InvalidRequestError  # noqa: E402
from transformers_reference import greedy_with_logprobs  # noqa: E402
from model_utils import save_tiny_model  # noqa: E402
from spec_utils import tiny_prompts, tokens  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(unavailable_reason(DEVICE) is not None,
                                reason=f"Triton cannot run here: {unavailable_reason(DEVICE)}")
# fewer tokens in the interpreter, where each step runs the kernels in Python
GREEDY = SamplingParams(temperature=0, max_tokens=20 if DEVICE == "cuda" else 8, ignore_eos=True)


@pytest.fixture(scope="module")
def tokenizer_path():
    if os.environ.get("KVSERVE_TEST_TOKENIZER"):
        return os.environ["KVSERVE_TEST_TOKENIZER"]
    from kvserve.model import default_model_path
    return default_model_path()


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """family -> (path, transformers model in float32 on DEVICE)."""
    root = tmp_path_factory.mktemp("triton-engine")
    out = {}
    for family, overrides in (("qwen2", {}), ("llama", dict(num_attention_heads=6, num_key_value_heads=2,
                                                           hidden_size=96)), ("qwen3", {})):
        model = save_tiny_model(family, root / family, vocab_size=96, **overrides)
        out[family] = (str(root / family), model.to(DEVICE))
    return out


def engine(path, tokenizer_path, backend="triton", **kwargs):
    kwargs.setdefault("num_kv_blocks", 64)
    return LLM(model=path, tokenizer=tokenizer_path, dtype="float32", device=DEVICE, attention_backend=backend,
               **kwargs)


def hf_greedy(model, prompts, max_tokens):
    """transformers' greedy output (transformers_reference.greedy_with_logprobs), as LLM.generate's token ids."""
    return [[ids] for ids, _ in greedy_with_logprobs(model, [p["prompt_token_ids"] for p in prompts], max_tokens)]


@pytest.fixture(scope="module")
def qwen2_reference(tiny_models):
    """tiny_prompts(5) and transformers' greedy output for them on the tiny qwen2: every engine test's oracle."""
    prompts = tiny_prompts(5)
    return prompts, hf_greedy(tiny_models["qwen2"][1], prompts, GREEDY.max_tokens)


WITH_LOGPROBS = SamplingParams(temperature=0, max_tokens=GREEDY.max_tokens, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def qwen2_triton(tiny_models, tokenizer_path, qwen2_reference):
    """(engine, its greedy outputs with logprobs) on the tiny qwen2 and qwen2_reference's prompts: unsplit steps
    (the interpreter's programs fall short of the split target)."""
    llm = engine(tiny_models["qwen2"][0], tokenizer_path)
    return llm, llm.generate(qwen2_reference[0], WITH_LOGPROBS, use_tqdm=False)


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
def test_greedy_equals_transformers(tiny_models, tokenizer_path, qwen2_reference, qwen2_triton, family):
    path, model = tiny_models[family]
    if family == "qwen2":
        (llm, outs), reference = qwen2_triton, qwen2_reference[1]
    else:
        prompts = tiny_prompts(3)
        llm = engine(path, tokenizer_path)
        outs, reference = llm.generate(prompts, GREEDY, use_tqdm=False), hf_greedy(model, prompts, GREEDY.max_tokens)
    assert llm.llm_engine.runner.attention_backend.name == "triton"
    assert tokens(outs) == reference


def test_split_kv_decodes_equal_transformers(tiny_models, tokenizer_path, qwen2_reference, qwen2_triton,
                                             monkeypatch):
    """The decode steps split each sequence's keys (split KV, as on a GPU: a target of programs that the tests'
    steps fall short of): the outputs are still transformers', and their logprobs those of unsplit steps."""
    from kvserve.attention.triton import ops
    path, _ = tiny_models["qwen2"]
    prompts, reference = qwen2_reference
    unsplit = [c.cumulative_logprob for o in qwen2_triton[1] for c in o.outputs]
    splits = []
    real = ops.decode_splits
    monkeypatch.setattr(ops, "INTERPRETER_SPLIT_TARGET", 64)
    monkeypatch.setattr(ops, "decode_splits", lambda *args: splits.append(real(*args)) or splits[-1])
    outs = engine(path, tokenizer_path).generate(prompts, WITH_LOGPROBS, use_tqdm=False)
    assert max(splits) >= 4
    assert tokens(outs) == reference
    assert [c.cumulative_logprob for o in outs for c in o.outputs] == pytest.approx(unsplit, abs=1e-4)


def test_batching_chunked_prefill_preemption_and_prefix_caching(tiny_models, tokenizer_path, qwen2_reference):
    """Small steps chunk the prompts, a small pool preempts requests, and the last prompts run again (from the
    prefix cache): the outputs are still transformers' (so the torch reference backend's too)."""
    path, _ = tiny_models["qwen2"]
    prompts, reference = qwen2_reference
    llm = engine(path, tokenizer_path, max_num_batched_tokens=24, num_kv_blocks=6, block_size=16, max_num_seqs=4)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert tokens(llm.generate(prompts[3:], GREEDY, use_tqdm=False)) == reference[3:]
    assert llm.llm_engine.scheduler.prefix_cache_hits > 0


def test_speculative_decoding_equals_no_speculation(tiny_models, tokenizer_path):
    path, model = tiny_models["qwen2"]
    prompts = [{"prompt_token_ids": ([5, 6, 7, 8] * 6)[:20 + i]} for i in range(3)]   # repeats for the n-gram
    spec = engine(path, tokenizer_path, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                            "prompt_lookup_max": 3})
    assert tokens(spec.generate(prompts, GREEDY, use_tqdm=False)) == hf_greedy(model, prompts, GREEDY.max_tokens)


def test_the_triton_backend_refuses_what_it_cannot_run(tiny_models, tokenizer_path):
    path, _ = tiny_models["qwen2"]
    with pytest.raises(InvalidRequestError, match="power of two"):
        engine(path, tokenizer_path, block_size=8)
    with pytest.raises(InvalidRequestError, match="attention_backend must be one of"):
        engine(path, tokenizer_path, backend="flash")


def test_capture_sizes():
    from kvserve.worker.cuda_graphs import capture_sizes
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_sizes(128)[-3:] == [96, 112, 128]
    assert capture_sizes(10_000)[-1] == 512


def test_decode_steps_through_the_graph_buffers_equal_eager_steps(tiny_models, tokenizer_path, qwen2_reference):
    """Decode steps run through DecodeGraphs' padded buffers (captured as CUDA graphs on a GPU, run eagerly on the
    CPU), batch sizes 1 to 4 padded to 1, 2, 4: the same greedy tokens as eager steps (transformers'), prefix
    caching and preemption included."""
    path, _ = tiny_models["qwen2"]
    prompts, eager = qwen2_reference
    llm = engine(path, tokenizer_path, max_num_seqs=4, num_kv_blocks=12, max_num_batched_tokens=40)
    runner = llm.llm_engine.runner
    if runner.decode_graphs is None:   # the CPU: the same buffers, eagerly
        runner.use_decode_graphs(4, llm.llm_engine.max_model_len, 16, capture=False)
    else:
        assert runner.decode_graphs.graphs   # captured at start on CUDA
    assert tokens(llm.generate(prompts + prompts[:2], GREEDY, use_tqdm=False)) == eager + eager[:2]
    assert runner.decode_graphs.num_runs > 0


def test_async_scheduling_through_the_graph_buffers(tiny_models, tokenizer_path, qwen2_reference):
    """Async scheduling (on by default on CUDA): each step launched behind the one in flight, its placeholders
    filled on the device into the graph buffers before the replay, through chunked prefill, preemption and prefix
    hits: transformers' tokens. On a GPU the launches run under torch's sync debug mode set to error: none may wait
    for the device."""
    path, _ = tiny_models["qwen2"]
    prompts, reference = qwen2_reference
    llm = engine(path, tokenizer_path, async_scheduling=True, max_num_seqs=4, num_kv_blocks=6,
                 max_num_batched_tokens=24)
    runner = llm.llm_engine.runner
    if runner.decode_graphs is None:
        runner.use_decode_graphs(4, llm.llm_engine.max_model_len, 16, capture=False)
    launch, filled = runner.launch, []

    def checked(sched, prev):
        if DEVICE == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            pending = launch(sched, prev)
        finally:
            if DEVICE == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        return pending
    graphs, run = runner.decode_graphs, runner.decode_graphs.run

    def counted(*args):
        filled.append(args[-1] is not None)   # the fill-in of the placeholders
        return run(*args)
    runner.launch, graphs.run = checked, counted
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert tokens(llm.generate(prompts[3:], GREEDY, use_tqdm=False)) == reference[3:]
    assert llm.llm_engine.scheduler.prefix_cache_hits > 0
    assert runner.decode_graphs.num_runs > 0 and sum(filled) > 10


def test_a_whole_decode_step_compiles_with_fullgraph(tiny_models, tokenizer_path):
    """The model's forward over the graph buffers (what a CUDA graph captures) traced whole by torch.compile with
    fullgraph=True: a host sync (.item(), .tolist(), a data-dependent shape) anywhere in the step would break the
    graph and fail here. The compiled step gives the eager step's hidden states."""
    from kvserve.worker.cuda_graphs import DecodeGraphs
    path, _ = tiny_models["qwen2"]
    llm = engine(path, tokenizer_path, enforce_eager=True)
    runner = llm.llm_engine.runner
    graphs = DecodeGraphs(runner.model, [4], 8, 16, torch.device(DEVICE), capture=False)
    args = ([5, 7, 9], [3, 10, 20], [4, 11, 21], [[1], [2], [3, 4]])
    eager = graphs.run(*args).clone()
    torch._dynamo.reset()
    graphs._forward = torch.compile(graphs._forward, fullgraph=True,
                                    backend="eager" if DEVICE == "cpu" else "inductor")
    with torch.inference_mode():
        compiled = graphs.run(*args)
    torch.testing.assert_close(compiled, eager)


def test_no_decode_replays_before_fp8_scales_are_calibrated(tiny_models):
    """A first step of one-token prompts must run the modules eagerly, where the layers calibrate their FP8 scales:
    DecodeGraphs takes no step while any layer still waits to calibrate."""
    from kvserve.attention import attention_layers, bind_kv_cache
    from kvserve.attention.backends import TritonPagedAttention
    from kvserve.config import EngineConfig
    from kvserve.model import load_model
    from kvserve.worker.cuda_graphs import DecodeGraphs
    model, _ = load_model(EngineConfig(model=tiny_models["qwen2"][0], dtype="float32", device=DEVICE))
    bind_kv_cache(model, 8, 16, torch.float8_e4m3fn, DEVICE, TritonPagedAttention(DEVICE), calculate_kv_scales=True)
    graphs = DecodeGraphs(model, [1, 2], 8, 16, torch.device(DEVICE), capture=False)
    assert not graphs.can_run([1, 1], [1, 1])
    for layer in attention_layers(model):   # what the first eager step does
        layer.calibrate_kv_scales = False
    assert graphs.can_run([1, 1], [1, 1])
    assert not graphs.can_run([1, 2], [1, 1]) and not graphs.can_run([1, 1, 1], [1, 1, 1])   # a prefill; too many
