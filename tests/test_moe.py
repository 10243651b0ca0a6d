"""Mixtures of experts (kvserve/model/moe.py): tiny random Mixtral, Qwen2-MoE (a shared expert, a dense layer),
Qwen3-MoE and OLMoE checkpoints give transformers' logits, and the engine's greedy output equals transformers' through
batching, chunked prefill, preemption and the prefix cache; the grouped experts equal a per-token loop in float32,
packed bf16 and int8 (odd token counts, top-k 1, 2 and 8, idle experts, every token on one expert) and run only the
experts chosen; LoRA on the attention of an MoE model equals peft, and adapters on experts are refused; speculative
decoding with a dense draft, structured outputs; what is not supported yet is refused with a clear error."""
from __future__ import annotations

import ctypes

import pytest
import torch

from kvserve import LLM, SamplingParams, kernels
from kvserve.attention import bind_kv_cache
from kvserve.errors import LoRAError, ModelLoadError
from kvserve.lora import LoRARequest
from kvserve.model.decoder import DecoderMLP
from kvserve.model.layers import prepack_linears
from kvserve.model.model_config import ModelConfig
from kvserve.model.moe import MoESpec, SparseMoE, expert_groups, moe_struct_layout
from kvserve.sampling_params import StructuredOutputsParams
from model_utils import MOE, check_engine_greedy, hf_logits, load_ours, run_single_sequence, save_tiny_model
from tokenizer_utils import load_smollm2_tokenizer

PROMPT = list(range(3, 40))
MAX_TOKENS = 10


@pytest.fixture(scope="module", params=sorted(MOE))
def tiny(tmp_path_factory, request):
    """(path, transformers model) of a tiny random MoE of each family."""
    path = tmp_path_factory.mktemp(request.param)
    return str(path), save_tiny_model(request.param, path)


def test_tiny_moe_logits_match_transformers(tiny):
    path, hf = tiny
    ours, cfg = load_ours(path)
    blocks = [layer.mlp for layer in ours.model.layers]
    assert [isinstance(b, SparseMoE) for b in blocks] == [i in cfg.moe_layers for i in range(cfg.num_hidden_layers)]
    assert any(isinstance(b, SparseMoE) for b in blocks)
    torch.testing.assert_close(run_single_sequence(ours, PROMPT), hf_logits(hf, PROMPT), atol=1e-4, rtol=0)


def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                          do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_engine_greedy_equals_transformers(tiny, gguf_path):
    """One batch, then chunks of 7 tokens with a pool so small that requests are preempted, twice over with the
    prefix cache (the second time from cached blocks)."""
    path, hf = tiny

    def names_the_experts(engine):   # (float32: no MoE kernel line)
        assert "mixture of experts" in engine.weights_summary
    check_engine_greedy(path, gguf_path, lambda p: _hf_greedy(hf, p), 20, names_the_experts)


class CountedMLP(DecoderMLP):
    """The experts' MLP, counting its calls."""

    calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


def _block(num_experts: int, top_k: int, renormalize: bool, shared: int = 0, seed: int = 0) -> SparseMoE:
    """A random MoE block of hidden size 64 (experts of 48, SwiGLU)."""
    cfg = ModelConfig("MixtralForCausalLM", 256, 64, 48, 1, 4, 2, 16, 1e-6, 1e4, 128, False)
    block = SparseMoE(cfg, MoESpec(num_experts, top_k, 48, renormalize, shared),
                      lambda size: CountedMLP(64, size, "silu", False), "silu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return block


def _per_token(block: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """The reference: each token alone through its chosen experts, in increasing order, float32 sums."""
    weights, ids = block.route(x)
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1])
        for j in ids[t].argsort():
            acc += block.experts[int(ids[t, j])](x[t:t + 1])[0].float() * weights[t, j]
        if block.shared_expert is not None:
            acc += (torch.sigmoid(block.shared_expert_gate(x[t:t + 1]).float())
                    * block.shared_expert(x[t:t + 1]).float())[0]
        rows.append(acc.to(x.dtype))
    return torch.stack(rows)


@pytest.mark.parametrize("top_k,renormalize,shared", [(1, False, 0), (2, True, 0), (8, False, 32), (2, False, 40)])
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_grouped_experts_equal_a_per_token_loop(top_k, renormalize, shared, tokens):
    block = _block(8, top_k, renormalize, shared)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
    with torch.inference_mode():
        got = block(x)
        chosen = set(block.route(x)[1].flatten().tolist())
    # each chosen expert ran once, over all its tokens; the others not at all (a decode reads only their weights)
    assert [e.calls for e in block.experts] == [int(e in chosen) for e in range(8)]
    with torch.inference_mode():
        # float32 both ways, but a matmul over an expert's group of rows and one over a single row may sum in other
        # orders (by BLAS kernel, so by CPU: 1.3e-5 apart held to AVX2); a wrong expert or weight is off by far more
        torch.testing.assert_close(got, _per_token(block, x), atol=1e-4, rtol=1e-4)


def test_every_token_on_one_expert():
    """A router that sends every token to expert 3: one group holds them all, the other experts sit idle."""
    block = _block(8, 1, True)
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.weight[3] = 1.0
    x = torch.rand(9, 64) + 0.1   # positive rows: expert 3 scores highest for each
    with torch.inference_mode():
        groups = list(expert_groups(block.route(x)[1], 8))
        assert [(e, t.tolist()) for e, t, _ in groups] == [(3, list(range(9)))]
        got = block(x)
    assert [e.calls for e in block.experts] == [0, 0, 0, 1, 0, 0, 0, 0]
    with torch.inference_mode():
        torch.testing.assert_close(got, block.experts[3](x), atol=1e-6, rtol=0)   # weight 1 after renormalizing


@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_grouped_experts_in_bf16_kernels_equal_the_loop(top_k):
    """The experts through the packed bf16 kernels (or oneDNN where they do not build): grouped rows agree with each
    token alone to the dtype's rounding."""
    block = _block(8, top_k, True, 32).to(torch.bfloat16)
    num, _ = prepack_linears(block)
    assert num == 8 * 2 + 2 + 2   # the experts', the shared expert's and the gates' linears
    x = torch.randn(13, 64).to(torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(block(x).float(), _per_token(block, x).float(), atol=2e-2, rtol=2e-2)


def test_int8_experts_are_quantized_and_equal_the_loop(tiny):
    """quantization="int8": every expert linear keeps int8 blocks; grouped equals per token."""
    path, _ = tiny
    from kvserve.config import EngineConfig
    from kvserve.model import load_model
    model, cfg = load_model(EngineConfig(model=path, dtype="bfloat16", device="cpu", quantization="int8"))
    block = next(layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoE))
    linears = [m for e in block.experts for m in (e.gate_up_proj, e.down_proj)]
    # int8 blocks take inputs in multiples of 32 (Mixtral's tiny experts of 48 keep their down_proj dense)
    assert all((m.quantized is not None) == (m.weight.shape[1] % 32 == 0) for m in linears)
    assert any(m.quantized is not None for m in linears) and block.gate.quantized is None   # routing stays dense
    x = torch.randn(11, cfg.hidden_size).to(torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(block(x).float(), _per_token(block, x).float(), atol=2e-2, rtol=2e-2)


def test_moe_layers_run_in_the_fused_stack_or_say_why_not(tiny):
    """bf16 on the CPU: the stack runs the MoE blocks through moe.cpp (test_fused_layers.py compares it with the
    modules bit for bit); OLMoE's whole-projection q/k norm keeps the modules, whose MoE blocks still make one C++
    call each; a block switched off from its kernel is named."""
    path, hf = tiny
    if not kernels.load() or not kernels.load().kvserve_has_packed_matmul():
        pytest.skip("needs the packed bf16 kernels (AVX2 or AVX-512 BF16)")
    ours, _ = load_ours(path, "bfloat16")
    ours.prepack()
    bind_kv_cache(ours, num_blocks=4, block_size=16, dtype=torch.bfloat16)
    status = ours.model.fused_status()
    if hf.config.model_type == "olmoe":
        assert status == "the layer modules (layer 0: a q/k norm over the whole projections)"
    else:
        assert status == "the fused C++ layer stack"
    blocks = [layer.mlp for layer in ours.model.layers if isinstance(layer.mlp, SparseMoE)]
    assert all(b.kernel_refusal() is None for b in blocks)
    assert ours.model.moe_status() == "one C++ call each"
    blocks[0].use_kernel = False
    assert ours.model.moe_status() == "the torch ops (switched off)"
    i = next(i for i, layer in enumerate(ours.model.layers) if layer.mlp is blocks[0])
    if hf.config.model_type != "olmoe":
        assert ours.model.fused_status() == f"the layer modules (layer {i}: a mixture-of-experts MLP (switched off))"


def test_the_moe_struct_matches_the_library_layout():
    lib = kernels.load()
    if lib is None:
        pytest.skip("no C++ kernels")
    n = lib.kvserve_moe_layout(None)
    layout = (ctypes.c_int64 * n)()
    lib.kvserve_moe_layout(layout)
    assert list(layout) == moe_struct_layout()


def test_the_route_kernel_names_k_distinct_experts_even_for_nan_rows():
    """A row of NaN logits (a broken request's activations) still chooses k distinct experts in range (NaN weights,
    as torch's ops give), so the grouping never indexes outside its tables."""
    lib = kernels.load()
    if lib is None:
        pytest.skip("no C++ kernels")
    logits = torch.randn(3, 8).to(torch.bfloat16)
    logits[1] = float("nan")
    logits[2, 3] = float("inf")
    w, ids = torch.empty(3, 8), torch.empty(3, 8, dtype=torch.int32)
    lib.kvserve_moe_route(logits.data_ptr(), 3, 8, 8, 1, w.data_ptr(), ids.data_ptr())
    assert all(sorted(row) == list(range(8)) for row in ids.tolist())
    assert torch.isfinite(w[0]).all() and torch.isnan(w[1]).all()


@pytest.mark.parametrize("top_k,shared,quantize", [(1, 0, False), (2, 40, False), (8, 32, True)])
def test_the_moe_kernel_equals_the_torch_ops(top_k, shared, quantize):
    """moe.cpp's one call against the grouped torch ops on the same packed (or int8) experts: the same routing and
    the same experts' rows, summed in the same order, whether the kernel runs one expert per thread (top-1 and 2:
    a few rows an expert) or one expert at a time (top-8: every row on every expert); they differ only in the
    rounding of the shared expert's gate sigmoid (torch's vectorized one against the kernel's exp) in float32."""
    if not kernels.load() or not kernels.load().kvserve_has_packed_matmul():
        pytest.skip("needs the packed bf16 kernels (AVX2 or AVX-512 BF16)")
    from kvserve.model.quantization import quantize_linears_int8
    block = _block(8, top_k, True, shared).to(torch.bfloat16)
    if quantize:
        quantize_linears_int8(block)
    prepack_linears(block)
    assert block.kernel_refusal() is None
    x = torch.randn(21, 64).to(torch.bfloat16)
    with torch.inference_mode():
        got = block(x)
        assert [e.calls for e in block.experts] == [0] * 8   # one C++ call: no module ran
        block.use_kernel = False
        want = block(x)
    if shared:
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
    else:
        assert torch.equal(got, want)


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    """A tiny Qwen2-MoE with the SmolLM2 tokenizer beside it."""
    path = tmp_path_factory.mktemp("qwen2_moe_tok")
    hf = save_tiny_model("qwen2_moe", path, seed=3)
    load_smollm2_tokenizer().save_pretrained(str(path))
    return path, hf


def test_lora_on_the_attention_of_an_moe_model_equals_peft(qwen2_moe, tmp_path):
    from test_lora import GREEDY, PROMPTS, assert_matches, peft_greedy, run, save_adapter
    path, _ = qwen2_moe
    ref = save_adapter(path, tmp_path / "attn", ["q_proj", "k_proj", "v_proj", "o_proj"], 4, seed=2)
    want = [peft_greedy(ref, p, GREEDY.max_tokens) for p in PROMPTS]
    llm = LLM(str(path), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=64)
    assert_matches(run(llm, LoRARequest("attn", 1, str(tmp_path / "attn"))), want)
    # an adapter on the MLPs (here the experts' and the shared expert's projections) is refused, and the engine
    # keeps serving
    save_adapter(path, tmp_path / "mlp", ["q_proj", "gate_proj", "up_proj"], 4, seed=3)
    with pytest.raises(LoRAError, match="mixture-of-experts"):
        run(llm, LoRARequest("mlp", 2, str(tmp_path / "mlp")))
    assert_matches(run(llm, LoRARequest("attn", 1, str(tmp_path / "attn"))), want)


def test_speculative_decoding_with_a_dense_draft_and_structured_outputs(qwen2_moe, tmp_path, gguf_path):
    path, _ = qwen2_moe
    save_tiny_model("llama", tmp_path / "draft", seed=4)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (4, 9, 17)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = LLM(str(path), dtype="float32")
    want = [o.outputs[0].token_ids for o in alone.generate(prompts, params, use_tqdm=False)]
    drafted = LLM(str(path), dtype="float32",
                  speculative_config={"model": str(tmp_path / "draft"), "num_speculative_tokens": 3})
    assert [o.outputs[0].token_ids for o in drafted.generate(prompts, params, use_tqdm=False)] == want
    assert drafted.llm_engine.scheduler.stats().spec_decoding.num_draft_tokens > 0
    # (choices whose tokens lie inside the tiny model's 256-token vocabulary)
    choice = SamplingParams(temperature=0, max_tokens=6,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    assert alone.generate(prompts[1], choice, use_tqdm=False)[0].outputs[0].text in ("yes", "no")


def test_tp2_equals_tp1(tmp_path):
    """Each expert's (and the shared expert's) intermediate size split over two ranks, the router whole on each, one
    all-reduce of the block's weighted sum, a dense layer between MoE ones; with chunked prefill and preemption."""
    from test_tensor_parallel import check_tp2_equals_tp1
    save_tiny_model("qwen2_moe", tmp_path, seed=5)
    check_tp2_equals_tp1(tmp_path, num_kv_blocks=14)


def test_what_is_not_supported_yet_is_refused(qwen2_moe, tmp_path):
    from kvserve.distributed.plan import make_plans
    from kvserve.errors import InvalidRequestError
    from kvserve.model.model_config import ModelConfig
    save_tiny_model("olmoe", tmp_path / "olmoe")
    cfg = ModelConfig.from_hf_config(__import__("json").loads((tmp_path / "olmoe" / "config.json").read_text()))
    with pytest.raises(InvalidRequestError, match="OLMoE"):
        make_plans(cfg, 2)
    bad = tmp_path / "clip"
    save_tiny_model("olmoe", bad, clip_qkv=8.0)
    with pytest.raises(ModelLoadError, match="clip_qkv"):
        load_ours(str(bad))
    save_tiny_model("olmoe", tmp_path / "k", num_experts_per_tok=9)
    with pytest.raises(ModelLoadError, match="num_experts_per_tok"):
        load_ours(str(tmp_path / "k"))


GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}


def test_a_gguf_of_each_family_loads_to_the_same_logits(tiny, tmp_path):
    """llama.cpp's layout: the experts' projections as [E, rows, cols] stacks (ffn_gate_exps, ...), the router
    ffn_gate_inp, the shared expert's _shexp tensors, its MoE keys; Mixtral as a "llama" with experts."""
    from model_utils import write_tiny_gguf
    path, hf = tiny
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", hf, arch=GGUF_ARCH[hf.config.model_type])
    ours, cfg = load_ours(str(gguf))
    want, _ = load_ours(path)
    assert (cfg.architecture, cfg.num_experts, cfg.moe_layers) == (want.config.architecture, want.config.num_experts,
                                                                   want.config.moe_layers)
    torch.testing.assert_close(run_single_sequence(ours, PROMPT), hf_logits(hf, PROMPT), atol=1e-4, rtol=0)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K", "IQ4_XS"])
def test_gguf_experts_stay_quantized_and_equal_the_loop(tmp_path, qtype):
    """A quantized GGUF served kept quantized: every expert's matrices are views of its stack's blocks, multiplied by
    the quantized kernels; grouped equals per token in float32, the C++ block equals the torch ops in bf16, and the
    model stays near its dequantized self."""
    from kvserve.config import EngineConfig
    from kvserve.model import load_model
    from model_utils import write_tiny_gguf
    size = 256 if qtype[1] in "23" or qtype == "IQ4_XS" else 64   # super-blocks of 256 values
    hf = save_tiny_model("qwen2_moe", tmp_path / "hf", hidden_size=size, intermediate_size=size,
                         moe_intermediate_size=size, shared_expert_intermediate_size=size)
    gguf = str(write_tiny_gguf(tmp_path / "q.gguf", hf, arch="qwen2moe", qtype=qtype))
    for dtype in ("float32", "bfloat16"):
        kept, cfg = load_model(EngineConfig(model=gguf, dtype=dtype, device="cpu", quantization="gguf"))
        block = kept.model.layers[0].mlp
        assert all(m.quantized is not None and m.quantized.formats() == [qtype]
                   for e in [*block.experts, block.shared_expert] for m in (e.gate_up_proj, e.down_proj))
        assert block.gate.quantized is None   # the router as llama.cpp stores it, F32
        x = torch.randn(9, cfg.hidden_size).to(kept.model.norm.weight.dtype)
        with torch.inference_mode():
            if dtype == "float32":
                torch.testing.assert_close(block(x), _per_token(block, x), atol=1e-5, rtol=1e-5)
            elif kernels.load() is not None and kernels.load().silu_mul_fast:
                kept.prepack()
                got = block(x)
                block.use_kernel = False
                torch.testing.assert_close(got.float(), block(x).float(), atol=1e-2, rtol=1e-2)
    dense, _ = load_ours(gguf)
    kept, _ = load_model(EngineConfig(model=gguf, dtype="float32", device="cpu", quantization="gguf"))
    torch.testing.assert_close(run_single_sequence(kept, PROMPT), run_single_sequence(dense, PROMPT), atol=0.15,
                               rtol=0)
