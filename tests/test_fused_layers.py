"""The one-call C++ layer stack (kvserve/model/fused.py) gives bit-identical results to the per-layer modules."""
from __future__ import annotations

import ctypes
import dataclasses

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve import kernels
from kvserve.attention import (CpuPagedAttention, TorchPagedAttention, attention_layers, bind_kv_cache,
                               build_attention_metadata, fp8, kv_layout)
from kvserve.config import EngineConfig
from kvserve.model import load_model
from kvserve.model.fused import struct_layout
from model_utils import load_ours, save_tiny_model, write_tiny_gguf

_lib = kernels.load()
pytestmark = pytest.mark.skipif(_lib is None or not _lib.silu_mul_fast,
                                reason="the fused layer stack needs the C++ kernels with AVX2 or AVX-512 BF16")
# dense bf16 linears run on the packed bf16 GEMM (AVX-512 BF16, or AVX2 widening the weights); quantized ones too
needs_bf16_gemm = pytest.mark.skipif(_lib is None or not _lib.kvserve_has_packed_matmul(),
                                     reason="dense bf16 linears in the stack need the packed bf16 GEMM (AVX2 or AVX-512 BF16)")

A, B = list(range(3, 43)), [7, 9, 11, 13, 200, 3]
# token ranges of A and B per step: chunked prefill, a mixed step, then decodes of both
STEPS = [((0, 17), (0, 5)), ((17, 40), (5, 6)), ((40, 41), None), ((41, 42), (6, 7))]


def _run_steps(model, block_size: int, backend=None, kv_dtype=torch.bfloat16,
               kv_scales=None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Logits of every step of STEPS (fresh pools, scattered blocks) and the first layer's pools afterwards.
    kv_scales: FP8 pools' [K, V] scales, the same in every layer."""
    (k, v), *_ = bind_kv_cache(model, num_blocks=16, block_size=block_size, dtype=kv_dtype, backend=backend)
    for layer in attention_layers(model):
        layer.kv_scales.copy_(kv_scales if kv_scales is not None else torch.ones(2))
    tables = [[5, 0, 7, 2, 1, 6, 9, 10, 11, 12, 13, 14, 15, 8][:-(-42 // block_size)], [3, 4]]
    a_tokens, b_tokens = A + [50, 51], B + [60]
    out = []
    for step_a, step_b in STEPS:
        ids, pos, qlens, slens, used = [], [], [], [], []
        for seq, rng, table in ((a_tokens, step_a, tables[0]), (b_tokens, step_b, tables[1])):
            if rng is not None:
                ids += seq[rng[0]:rng[1]]
                pos += list(range(*rng))
                qlens.append(rng[1] - rng[0])
                slens.append(rng[1])
                used.append(table)
        meta = build_attention_metadata(qlens, slens, used, block_size=block_size)
        with torch.inference_mode():
            out.append(model.compute_logits(model(torch.tensor(ids), torch.tensor(pos), meta)))
    return out, [k.view(torch.uint8).clone(), v.view(torch.uint8).clone()]


def _tiny_bf16(tmp_path, family: str = "llama", **overrides):
    save_tiny_model(family, tmp_path, **overrides)
    model, _ = load_ours(str(tmp_path), "bfloat16")
    model.prepack()
    return model


@needs_bf16_gemm
@pytest.mark.parametrize("head_dim,block_size", [(32, 16), (32, 4), (16, 16)])
def test_fused_stack_is_bit_identical_to_the_modules(tmp_path, head_dim, block_size):
    """Tiled pools (head dim 32, blocks of 16) and standard ones; the same model rebinds its pools between runs,
    so the third run also checks that the stack follows the new pools instead of writing into freed ones."""
    model = _tiny_bf16(tmp_path, hidden_size=4 * head_dim, intermediate_size=96)
    tiled = kv_layout.can_tile(torch.bfloat16, block_size, head_dim, kernels.MAX_HEAD_DIM) and _lib.kvserve_bf16_tiles()
    fused, fused_pools = _run_steps(model, block_size)
    assert model.model._fused is not None and bool(model.model._fused.tiled) == tiled
    model.model.use_fused_layers = False
    modules, module_pools = _run_steps(model, block_size)
    assert model.model._fused is not None   # kept, but not called: the modules ran
    model.model.use_fused_layers = True
    again, again_pools = _run_steps(model, block_size)
    for got, want, twice in zip(fused, modules, again):
        assert got.dtype == torch.float32 and torch.equal(got, want) and torch.equal(twice, want)
    for got, want, twice in zip(fused_pools, module_pools, again_pools):
        assert torch.equal(got, want) and torch.equal(twice, want)


def test_the_builds_that_widen_bf16_weights_run_the_stack_bit_identical_to_the_modules(tmp_path):
    """What an AVX2 CPU and an AVX-512 CPU without BF16 run (bf16 weights widened to float32 in registers; the
    GEMM's tiles on 8 and on 16 lanes), each built where the CPU has more: the stack equals the modules, and the two
    builds give the same bits (head dim 16: both run the AVX2 attention kernel; the AVX-512 one, for head dims
    that are multiples of 32, sums in another order)."""
    names = kernels.distinct_builds(("no-avx512", "no-avx512bf16"))
    if any(lib is None or lib.kvserve_packed_matmul_kind() != 2 for lib in map(kernels.load_variant, names)):
        pytest.skip("no build here widens bf16 weights")
    runs = {}
    for name in names:
        with kernels.variant(name) as lib:
            model = _tiny_bf16(tmp_path / name, hidden_size=64, intermediate_size=96)
            backend = CpuPagedAttention(lib)   # this build's attention, on pools it does not tile
            fused, fused_pools = _run_steps(model, 16, backend)
            assert model.model._fused is not None and not model.model._fused.tiled
            model.model.use_fused_layers = False
            modules, module_pools = _run_steps(model, 16, backend)
        assert all(torch.equal(a, b) for a, b in zip(fused + fused_pools, modules + module_pools))
        runs[name] = fused
    assert all(torch.equal(a, b) for a, b in zip(runs[names[0]], runs[names[-1]]))


def _tiny_quantized_bf16(tmp_path, qtype: str, **overrides):
    """A tiny llama written as a GGUF of `qtype` blocks, loaded with them kept, bf16 activations."""
    hf = save_tiny_model("llama", tmp_path / "hf", **overrides)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", hf, qtype=qtype)
    model, _ = load_model(EngineConfig(model=str(path), dtype="bfloat16", device="cpu", quantization="gguf"))
    model.prepack()
    assert model.model.layers[0].mlp.down_proj.quantized.formats() == [qtype]
    return model


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q5_0", "IQ4_NL", "Q2_K", "Q3_K", "IQ4_XS"])
def test_fused_stack_runs_quantized_linears_bit_identical_to_the_modules(tmp_path, qtype):
    """GGUF-quantized linears enter the stack through their linear method (kvserve_quant_matmul, as the modules
    call it): chunked prefill, a mixed step and decodes, then a split decode batch, all bit-identical (Q2_K, Q3_K,
    IQ4_XS: the formats on 256-value activation blocks)."""
    sizes = {"hidden_size": 256, "intermediate_size": 256} if qtype.endswith(("K", "XS")) else \
        {"hidden_size": 128, "intermediate_size": 96}
    check_quantized_stack(_tiny_quantized_bf16(tmp_path, qtype, **sizes))


def test_fused_stack_runs_a_draft_requantized_to_q4_0_bit_identical_to_the_modules(tmp_path):
    """A speculative draft's layers requantized at load (quantize_layers_q4_0, draft_quantization) are ordinary
    quantized linears to the stack: bit-identical to the modules."""
    hf = save_tiny_model("llama", tmp_path / "hf", hidden_size=128, intermediate_size=96)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", hf, qtype="Q8_0")
    model, _ = load_model(EngineConfig(model=str(path), dtype="bfloat16", device="cpu", quantization="gguf"))
    assert model.quantize_layers_q4_0(stored_only=True)["Q8_0"] > 0
    model.prepack()
    assert model.model.layers[0].mlp.down_proj.quantized.formats() == ["Q4_0"]
    check_quantized_stack(model)


def test_fused_stack_follows_linears_whose_method_is_replaced_after_it_was_built(tmp_path):
    """Requantizing some linears of a model that already ran on the same pools (each linear's method replaced on
    its own) rebuilds the stack on the new weights: bit-identical to the modules, never the freed ones."""
    hf = save_tiny_model("llama", tmp_path / "hf", hidden_size=128, intermediate_size=96)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", hf, qtype="Q8_0")
    model, _ = load_model(EngineConfig(model=str(path), dtype="bfloat16", device="cpu", quantization="gguf"))
    model.prepack()
    bind_kv_cache(model, num_blocks=4, block_size=16, dtype=torch.bfloat16)
    ids, meta = torch.tensor(A[:20]), build_attention_metadata([20], [20], [[2, 0]], block_size=16)

    def logits():
        with torch.inference_mode():
            return model.compute_logits(model(ids, torch.arange(20), meta))
    before = logits()
    built = model.model._fused
    assert built is not None
    assert model.quantize_layers_q4_0(stored_only=True)["Q8_0"] > 0
    fused = logits()
    assert model.model._fused is not built and not torch.equal(fused, before)
    model.model.use_fused_layers = False
    assert torch.equal(fused, logits())


def test_fused_stack_refuses_a_quantized_weight_it_cannot_multiply(tmp_path):
    """A quantized linear whose descriptor names a type kvserve_quant_matmul does not take stops the stack with an
    error naming the layer, as the modules path raises (no silent garbage); the same step runs once it is whole."""
    model = _tiny_quantized_bf16(tmp_path, "Q4_1", hidden_size=128, intermediate_size=96)
    _run_steps(model, 16)
    assert model.model._fused is not None
    desc = model.model.layers[1].mlp.down_proj.quantized.desc
    good = int(desc[1])
    desc[1] = 99
    with pytest.raises(RuntimeError, match="layer 1"):
        _run_steps(model, 16)
    model.model.use_fused_layers = False
    with pytest.raises(RuntimeError, match="does not know"):
        _run_steps(model, 16)
    desc[1] = good
    model.model.use_fused_layers = True
    assert all(torch.isfinite(x).all() for x in _run_steps(model, 16)[0])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)   # a decode step of 40 sequences split between the threads, each stopping in layer 1
    try:
        with pytest.raises(RuntimeError, match="layer 1"):
            _run_batch_decodes(model, [1, 70, 3, 40, 2, 9, 110, 5] * 5, 1,
                               after_prefill=lambda: desc.__setitem__(1, 99))
    finally:
        torch.set_num_threads(threads)
        desc[1] = good


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fused_stack_on_fp8_pools_is_bit_identical_to_the_modules(tmp_path, kv_dtype):
    """FP8 pools (layer scales folded into the attention as the backend does for the modules); dense bf16
    linears where the CPU has their GEMM, else Q8_0 ones."""
    model = (_tiny_bf16(tmp_path, hidden_size=128, intermediate_size=96) if _lib.kvserve_has_packed_matmul() else
             _tiny_quantized_bf16(tmp_path, "Q8_0", hidden_size=128, intermediate_size=96))
    check_quantized_stack(model, kv_dtype, torch.tensor([0.05, 0.01]))


def check_quantized_stack(model, kv_dtype=torch.bfloat16, kv_scales=None) -> None:
    """The stack against the modules on `model` (quantized linears, or dense): STEPS, then a split decode batch against
    the unsplit modules; logits and pools bit-identical. kv_dtype, kv_scales: the pools' (FP8 ones)."""
    fused, fused_pools = _run_steps(model, 16, kv_dtype=kv_dtype, kv_scales=kv_scales)
    assert model.model._fused is not None and model.model._fused.kv_format == fp8.FORMATS.get(kv_dtype, 0)
    model.model.use_fused_layers = False
    modules, module_pools = _run_steps(model, 16, kv_dtype=kv_dtype, kv_scales=kv_scales)
    assert all(torch.isfinite(x).all() and x.abs().max() < 1e3 for x in fused)   # a model, not stray memory
    for got, want in zip(fused + fused_pools, modules + module_pools):
        assert torch.equal(got, want)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = []
        for fused_on, split in ((True, True), (False, False)):
            model.model.use_fused_layers, model.model.split_decode_batches = fused_on, split
            runs.append(_run_batch_decodes(model, [1, 70, 3, 40, 2, 9, 110, 5] * 5, 2, kv_dtype, kv_scales))
    finally:
        torch.set_num_threads(threads)
    (a_logits, a_pools), (b_logits, b_pools) = runs
    assert all(torch.equal(x, y) for x, y in zip(a_logits + a_pools, b_logits + b_pools))


def _run_batch_decodes(model, lens: list[int], steps: int, kv_dtype=torch.bfloat16, kv_scales=None,
                       after_prefill=None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Prefill len(lens) sequences of the given lengths in one step, then decode all of them `steps` times
    (after_prefill: called between the two)."""
    bs = 16
    blocks = [-(-(n + steps) // bs) for n in lens]
    perm = torch.randperm(sum(blocks), generator=torch.Generator().manual_seed(0)).tolist()   # scattered blocks
    tables = [perm[sum(blocks[:i]):sum(blocks[:i + 1])] for i in range(len(lens))]
    (k, v), *_ = bind_kv_cache(model, num_blocks=sum(blocks), block_size=bs, dtype=kv_dtype)
    for layer in attention_layers(model):
        layer.kv_scales.copy_(kv_scales if kv_scales is not None else torch.ones(2))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 60, (sum(lens),), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lens])
    out = []
    with torch.inference_mode():
        out.append(model.compute_logits(model(ids, pos, build_attention_metadata(lens, lens, tables, block_size=bs))))
        if after_prefill is not None:
            after_prefill()
        for s in range(steps):
            ctx = [n + s + 1 for n in lens]
            meta = build_attention_metadata([1] * len(lens), ctx, tables, block_size=bs)
            ids = torch.randint(3, 60, (len(lens),), generator=gen)
            out.append(model.compute_logits(model(ids, torch.tensor(ctx) - 1, meta)))
    return out, [k.view(torch.uint8).clone(), v.view(torch.uint8).clone()]


def test_fused_stack_splitting_a_decode_batch_between_threads_is_bit_identical(tmp_path):
    """Decode-only steps of 24+ sequences split the batch between the threads (each runs the whole stack on its
    share, cut by estimated cost: uneven context lengths give uneven shares); the results stay bit-identical to
    the unsplit stack and to the modules."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)   # the split needs 2+ threads
    try:
        model = _tiny_bf16(tmp_path, hidden_size=128, intermediate_size=96)
        lens = [1, 70, 3, 40, 2, 9, 110, 5] * 5
        runs = []
        for fused, split in ((True, True), (True, False), (False, False)):
            model.model.use_fused_layers, model.model.split_decode_batches = fused, split
            runs.append(_run_batch_decodes(model, lens, 3))
    finally:
        torch.set_num_threads(threads)
    (split_logits, split_pools), *others = runs
    for logits, pools in others:
        assert all(torch.equal(a, b) for a, b in zip(split_logits, logits))
        assert all(torch.equal(a, b) for a, b in zip(split_pools, pools))


# every family's declared features in the stack: windows shorter than the prompts (mistral, gemma), q/k norm
# (qwen3, gemma3), a second RoPE table (gemma3), soft-capped attention (gemma2), GELU-tanh and sandwich norms (gemma),
# mixtures of experts (top-2, top-1 with a shared expert and a dense layer between, top-8; moe.cpp)
FAMILIES = {"mistral": {"sliding_window": 8}, "qwen3": {}, "gemma2": {}, "gemma3": {}, "phi3": {}, "mixtral": {},
            "qwen2_moe": {}, "qwen3_moe": {}}


# every family dense and int8 (int8 experts: one MoE family here, the others in test_moe.py's kernel tests)
@pytest.mark.parametrize("family,quantization", [(f, q) for f in sorted(FAMILIES) for q in ("none", "int8")
                                                 if q == "none" or f not in ("mixtral", "qwen3_moe")])
def test_every_family_runs_the_fused_stack_bit_identical_to_the_modules(tmp_path, family, quantization):
    """Each family's tiny model, dense bf16 linears (where the CPU has their GEMM) and int8 ones: STEPS and a split
    decode batch, logits and pools bit-identical to the modules; then on FP8 pools."""
    if quantization == "none" and not _lib.kvserve_has_packed_matmul():
        pytest.skip("dense bf16 linears in the stack need the packed bf16 GEMM (AVX2 or AVX-512 BF16)")

    save_tiny_model(family, tmp_path, **FAMILIES[family])
    model, _ = load_model(EngineConfig(model=str(tmp_path), dtype="bfloat16", device="cpu",
                                       quantization=quantization))
    model.prepack()
    check_quantized_stack(model)
    model.model.use_fused_layers = model.model.split_decode_batches = True
    check_quantized_stack(model, torch.float8_e5m2, torch.tensor([0.05, 0.01]))


def test_the_stack_refuses_what_it_has_no_kernel_for_and_says_which(tmp_path):
    """An activation the stack does not know keeps the modules, and fused_status names it."""
    model = _tiny_bf16(tmp_path, "llama", hidden_size=128, intermediate_size=96) \
        if _lib.kvserve_has_packed_matmul() else _tiny_quantized_bf16(tmp_path, "Q8_0", hidden_size=128,
                                                                       intermediate_size=96)
    bind_kv_cache(model, num_blocks=4, block_size=16, dtype=torch.bfloat16)
    assert model.model.fused_status() == "the fused C++ layer stack"
    layer = model.model.layers[1]
    layer.spec = dataclasses.replace(layer.spec, activation="relu2")
    assert model.model.fused_status() == "the layer modules (layer 1: activation relu2)"


def test_the_stack_structs_match_the_library_layout():
    """The ctypes mirrors of layers.cpp's structs (fused.py) have the library's sizes and field offsets."""
    n = _lib.kvserve_stack_layout(None)
    layout = (ctypes.c_int64 * n)()
    _lib.kvserve_stack_layout(layout)
    assert list(layout) == struct_layout()


def test_more_query_heads_per_kv_head_than_a_work_item_holds_run_as_modules(tmp_path):
    """66 query heads on one kv head do not fit the attention kernels' 64 rows of a work item: the stack is not
    built, and the modules leave attention to the torch backend."""
    save_tiny_model("llama", tmp_path, hidden_size=66 * 16, num_attention_heads=66, num_key_value_heads=1,
                    intermediate_size=96)
    model, _ = load_model(EngineConfig(model=str(tmp_path), dtype="bfloat16", device="cpu", quantization="int8"))
    model.prepack()
    logits, _ = _run_steps(model, 16)
    assert model.model._fused is None and model.model._fused_refused is not None
    assert all(torch.isfinite(x).all() for x in logits)


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_fused_stack_adds_qwen2_qkv_biases_bit_identical_to_the_modules(tmp_path, quantization):
    """Qwen2's q|k|v bias, on dense bf16 linears and on int8 ones (then on FP8 pools too)."""
    if quantization == "none" and not _lib.kvserve_has_packed_matmul():
        pytest.skip("dense bf16 linears in the stack need the packed bf16 GEMM (AVX2 or AVX-512 BF16)")

    save_tiny_model("qwen2", tmp_path, hidden_size=128, intermediate_size=96)
    model, _ = load_model(EngineConfig(model=str(tmp_path), dtype="bfloat16", device="cpu",
                                       quantization=quantization))
    model.prepack()
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None
    check_quantized_stack(model)
    if quantization == "int8":   # check_quantized_stack ends on the modules
        model.model.use_fused_layers = model.model.split_decode_batches = True
        check_quantized_stack(model, torch.float8_e4m3fn, torch.tensor([0.05, 0.01]))


def test_torch_backend_and_float32_run_as_modules(tmp_path):
    model = _tiny_bf16(tmp_path)
    _run_steps(model, 16, backend=TorchPagedAttention())
    assert model.model._fused is None
    float32, _ = load_ours(str(tmp_path), "float32")
    bind_kv_cache(float32, num_blocks=4, block_size=16, dtype=torch.float32)
    with torch.inference_mode():
        float32(torch.tensor([1, 2]), torch.arange(2), build_attention_metadata([2], [2], [[0]], block_size=16))
    assert float32.model._fused is None and float32.model._fused_refused is None   # never even tried


def _engine_outputs(llm, prompts, params, rounds: int) -> list:
    llm.reset_prefix_cache()
    outs = []
    for _ in range(rounds):   # later rounds read the prefix cache the first one filled
        outs += [c for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]
    return [(c.token_ids, [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs]) for c in outs]


def _outputs_with_and_without(llm, switch: str, prompts, params, rounds: int) -> dict[bool, list]:
    """_engine_outputs with the DecoderModel switch `switch` on, then off."""
    stack = llm.llm_engine.model.model
    runs = {}
    for flag in (True, False):
        setattr(stack, switch, flag)
        runs[flag] = _engine_outputs(llm, prompts, params, rounds)
    return runs


def test_engine_greedy_tokens_and_logprobs_identical_with_and_without_fused_stack():
    """The bundled SmolLM2 in bf16 through the whole engine: batched prefill and decode, with logprobs."""
    llm = LLM(dtype="bfloat16", max_model_len=512, enable_prefix_caching=False)
    prompts = ["The capital of France is", "def fibonacci(n):", "Write a haiku about paged attention."]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=3)
    runs = _outputs_with_and_without(llm, "use_fused_layers", prompts, params, 1)
    assert llm.llm_engine.model.model._fused is not None
    assert runs[True] == runs[False]


def test_engine_with_chunks_prefix_hits_and_shared_samples_identical_with_and_without_fused_stack():
    """Chunked prefill (32-token budget), prefix-cache hits (a shared prefix, then the same prompts again) and
    n = 2 seeded samples sharing their prompt's blocks (copy-on-write): both paths read the same pools."""
    llm = LLM(dtype="bfloat16", max_model_len=512, max_num_batched_tokens=32, block_size=16)
    prefix = "You are a careful assistant. Answer briefly and precisely, in one sentence. Question: "
    prompts = [prefix + q for q in ("Why is the sky blue?", "What is a block table?", "Name a prime.")]
    params = SamplingParams(n=2, max_tokens=20, temperature=0.8, seed=7, ignore_eos=True, logprobs=2)
    runs = _outputs_with_and_without(llm, "use_fused_layers", prompts, params, 2)
    assert llm.llm_engine.model.model._fused is not None and len(runs[True]) == 12
    assert runs[True] == runs[False]


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_engine_on_kv_groups_identical_with_and_without_fused_stack(tmp_path, gguf_path, family):
    """A tiny Gemma in bf16 (sliding-window layers in their own KV group, whose blocks leave the pool) through the
    engine: chunks of 7 tokens, a pool small enough to preempt, the prefix cache hit on the second round."""
    if not _lib.kvserve_has_packed_matmul():
        pytest.skip("dense bf16 linears in the stack need the packed bf16 GEMM (AVX2 or AVX-512 BF16)")
    save_tiny_model(family, tmp_path)
    llm = LLM(model=str(tmp_path), tokenizer=gguf_path, dtype="bfloat16", max_num_batched_tokens=7, num_kv_blocks=40,
              block_size=4, max_num_seqs=4, enable_prefix_caching=True)
    assert llm.llm_engine.kv.groups.windows == (None, 8, 8)
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 256, (13,), generator=g).tolist()
    prompts = [{"prompt_token_ids": shared + torch.randint(3, 256, (n,), generator=g).tolist()} for n in (3, 11, 30)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    runs = _outputs_with_and_without(llm, "use_fused_layers", prompts, params, 2)
    assert llm.llm_engine.model.model._fused is not None
    stats = llm.llm_engine.scheduler.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert runs[True] == runs[False]


def test_speculative_verification_in_the_fused_stack_is_identical_to_the_modules():
    """n-gram drafts: each verification step runs k + 1 query tokens of a sequence through the fused stack."""
    llm = LLM(dtype="bfloat16", max_model_len=512,
              speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    code = "def area(w, h):\n    result = w * h\n    return result\n"
    prompts = [f"Repeat this code exactly:\n{code}", f"Rename result to value:\n{code}"]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=2)
    runs = _outputs_with_and_without(llm, "use_fused_layers", prompts, params, 1)
    assert llm.llm_engine.model.model._fused is not None
    assert llm.llm_engine.scheduler.spec_stats.num_accepted_tokens > 0
    assert runs[True] == runs[False]


@needs_bf16_gemm
def test_serving_keeps_one_copy_of_the_packed_weights():
    """The engine drops each packed Linear's plain bf16 weight (serving reads only the pack); restoring them from
    the packs gives back exactly the loaded weights, and the engine's tokens do not change."""
    from kvserve.model.layers import Linear, restore_unpacked_weights
    from kvserve.model.linear_method import DENSE, PackedBf16Method
    from model_utils import load_ours
    llm = LLM(dtype="bfloat16", quantization="none", max_model_len=256, enable_prefix_caching=False)
    model = llm.llm_engine.model
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    before = llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0].token_ids
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight.is_meta and isinstance(m.method, PackedBf16Method) for m in linears)
    embed = model.model.embed_tokens   # tied: the lookups read the head's pack, the table itself is released
    assert embed.weight.is_meta and embed.method is model.tied_head
    assert llm.llm_engine.runner.released_weight_bytes == sum(2 * m.weight.numel() for m in [*linears, embed])
    pack, linears[0].method = linears[0].method, DENSE
    with pytest.raises(RuntimeError, match="released after packing"):   # never used silently
        linears[0](torch.ones(1, linears[0].weight.shape[1], dtype=torch.bfloat16))
    linears[0].method = pack
    restore_unpacked_weights(model)
    ids = torch.tensor([0, 17, 5, 49151, 300])
    assert torch.equal(embed.method.rows(embed, ids), embed.weight[ids])   # the pack's rows are the table's
    fresh, _ = load_ours(None, "bfloat16")
    for (name, got), (_, want) in zip(model.named_parameters(), fresh.named_parameters()):
        assert name and torch.equal(got, want), name
    assert llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0].token_ids == before
    odd = torch.randn(100, 48).to(torch.bfloat16)   # N not a multiple of 16
    out = torch.empty(kernels.packed_numel(100, 48), dtype=torch.bfloat16)
    kernels.pack_weight(_lib, odd, out)
    assert torch.equal(PackedBf16Method(100, out, _lib).unpack(48), odd)


def test_engine_tokens_and_logprobs_identical_with_and_without_the_decode_split():
    """26 greedy requests decode together through the whole engine (the split applies from 24 sequences)."""
    threads = torch.get_num_threads()
    try:   # num_threads=2 (the split needs 2+) sets the process-wide count: put it back afterwards
        llm = LLM(dtype="bfloat16", max_model_len=256, enable_prefix_caching=False, num_threads=2)
        prompts = [f"Item {i}: the number {i * 7} written in words is" for i in range(26)]
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
        runs = _outputs_with_and_without(llm, "split_decode_batches", prompts, params, 1)
    finally:
        torch.set_num_threads(threads)
    assert len(runs[True]) == 26 and runs[True] == runs[False]
