"""GGUF models served with their quantized weights kept (quantization="gguf"): what is kept, accuracy against the
dequantized model (logits, greedy tokens; perplexity in test_perplexity.py), the engine's equivalences on the
quantized path, and bad inputs."""
import dataclasses

import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.entrypoints.perplexity import chunk_nll, chunk_tokens, perplexity
from kvserve.errors import InvalidRequestError, ModelLoadError
from kvserve.model import load_model
from kvserve.model.layers import Linear
from kvserve.model.quantization import quantized_matmul
from model_utils import run_single_sequence, save_tiny_model, write_tiny_gguf

TEXT = "tests/data/gpl-3.0.txt"
INT8_STEP = 48   # small steps: the equivalence tests see chunked prefill


def load(path, quantization, dtype="float32"):
    return load_model(EngineConfig(model=path, dtype=dtype, device="cpu", quantization=quantization))[0]


@pytest.fixture(scope="module")
def quantized_llm():
    return LLM(quantization="gguf", dtype="float32", kv_cache_memory="96MiB", max_num_batched_tokens=INT8_STEP)


@pytest.fixture(scope="module")
def dense_llm():
    return LLM(quantization="none", dtype="float32", kv_cache_memory="96MiB", max_num_batched_tokens=INT8_STEP)


def test_bundled_model_keeps_its_quantized_weights(quantized_llm):
    engine = quantized_llm.llm_engine
    model = engine.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.quantized is not None and m.weight.is_meta for m in linears)
    assert {f for m in linears for f in m.quantized.formats()} == {"Q4_1"}
    embed = model.model.embed_tokens
    assert embed.quantized.formats() == ["Q8_0"] and embed.weight.is_meta
    assert model.tied_head is embed.method   # tied: the lm_head multiplies the same blocks
    assert "Q4_1 x120" in engine.weights_summary and "Q8_0 x1" in engine.weights_summary
    quantized_bytes = sum(m.quantized.nbytes for m in linears) + embed.quantized.nbytes
    dense_bytes = sum(p.numel() * 4 for m in linears for p in [m.weight]) + embed.weight.numel() * 4
    assert quantized_bytes < dense_bytes / 5   # 4.5-8.5 bits a weight against 32


def test_default_keeps_gguf_quantized_and_none_dequantizes(gguf_path, dense_llm):
    from kvserve import kernels
    kept = load(gguf_path, "auto").model.layers[0].mlp.down_proj.quantized is not None
    assert kept == bool(kernels.load() is not None and kernels.load().kvserve_quant_simd())
    dense = dense_llm.llm_engine.model
    assert dense.model.layers[0].mlp.down_proj.quantized is None and dense.model.embed_tokens.quantized is None


def test_logits_close_to_the_dequantized_model(gguf_path):
    ids = (list(range(100, 100 + 40)) + [2, 28, 9, 444, 1005, 20]) * 3
    q = run_single_sequence(load(gguf_path, "gguf"), ids)
    d = run_single_sequence(load(gguf_path, "none"), ids)
    cos = torch.nn.functional.cosine_similarity(q, d, dim=-1)
    assert cos.min() > 0.99, cos.min()
    assert (q.argmax(-1) == d.argmax(-1)).float().mean() > 0.9


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
           "List three prime numbers:", "The GNU General Public License is", "import numpy as np\n",
           "Water boils at", "My favourite colour is"]


def greedy(llm, prompts, n=24):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0),
                                                        use_tqdm=False)]


def test_greedy_tokens_mostly_agree_with_the_dequantized_model(quantized_llm, dense_llm):
    q, d = greedy(quantized_llm, PROMPTS), greedy(dense_llm, PROMPTS)
    first = sum(a[0] == b[0] for a, b in zip(q, d))
    common = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(q, d)]
    print(f"greedy agreement: first token {first}/{len(PROMPTS)}, common prefix {np.mean(common):.1f} of 24")
    assert first >= len(PROMPTS) - 1
    assert np.mean(common) >= 8


def test_quantized_engine_equivalences(quantized_llm, gguf_path):
    # the int8 kernels give each row the same result whatever shares its step: batching, chunked prefill,
    # prefix caching and preemption change nothing
    alone = [greedy(quantized_llm, [p])[0] for p in PROMPTS]
    assert greedy(quantized_llm, PROMPTS) == alone
    assert greedy(quantized_llm, PROMPTS) == alone   # again, from the prefix cache
    # 96 tokens of KV for 8 sequences: preemption (the block size stays: it sets the attention's summation order)
    tight = LLM(quantization="gguf", dtype="float32", num_kv_blocks=6, max_num_batched_tokens=16,
                enable_prefix_caching=False)
    assert greedy(tight, PROMPTS) == alone
    assert tight.llm_engine.scheduler.num_preemptions > 0


def test_perplexity_scores_the_second_half_of_each_chunk():
    # 21 tokens and BOS: two whole chunks, the rest dropped; each chunk's first token is BOS
    chunks = chunk_tokens(list(range(10, 31)), 8, bos_id=1)
    assert chunks == [[1, 10, 11, 12, 13, 14, 15, 16], [1, 18, 19, 20, 21, 22, 23, 24]]
    assert chunk_tokens(list(range(10, 31)), 8, bos_id=None) == [list(range(10, 18)), list(range(18, 26))]

    class LP:
        def __init__(self, v):
            self.logprob = v
    # position p predicts chunk[p] from the tokens before it; llama-perplexity scores positions n/2+1 .. n-1
    logprobs = [None] + [{tok: LP(-float(pos))} for pos, tok in enumerate(chunks[0]) if pos > 0]
    nll, count = chunk_nll(logprobs, chunks[0])
    assert count == 3 and nll == 5 + 6 + 7


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q5_1", "Q2_K", "Q3_K", "IQ4_XS", "IQ4_NL"])
def test_tiny_llama_gguf_kept_quantized_matches_its_dequantized_self(tmp_path, qtype):
    # llama files permute q/k rows: the kept blocks are unpermuted by rows, as the dequantized weights are; the
    # K-quants' and IQ4_XS's rows are whole super-blocks of 256 (Q2_K, Q3_K, IQ4_XS: tests/model_utils.py's
    # quantizers)
    hf = save_tiny_model("llama", tmp_path / "hf", **({"hidden_size": 256, "intermediate_size": 512}
                                                      if qtype.endswith(("K", "XS")) else {}))
    path = str(write_tiny_gguf(tmp_path / "tiny.gguf", hf, qtype=qtype))
    kept, dense = load(path, "gguf"), load(path, "none")
    assert kept.model.layers[0].self_attn.qkv_proj.quantized.formats() == [qtype]
    ids = [5, 9, 200, 31, 7, 77, 120, 3]
    q, d = run_single_sequence(kept, ids), run_single_sequence(dense, ids)
    assert torch.nn.functional.cosine_similarity(q, d, dim=-1).min() > 0.995


def test_real_blocks_of_every_format_in_the_qwen_files(qwen_05b_path):
    # Q5_0, Q8_0, Q4_K and Q6_K blocks as llama.cpp's quantizer wrote them, against gguf-py's dequantization
    from kvserve.model.gguf_loader import _quantized, open_gguf
    from kvserve.model.quantization import QuantizedWeight
    reader = open_gguf(qwen_05b_path)
    seen = set()
    for t in reader.tensors:
        fmt = t.tensor_type.name
        if fmt in seen or len(t.shape) != 2 or int(t.shape[1]) > 8192:   # not the 151936-row vocab matrices
            continue
        seen.add(fmt)
        part = _quantized(t, None)   # its first 96 rows: gguf-py's dequantization of the whole is slow
        w = QuantizedWeight([dataclasses.replace(part, data=part.data[:96])])
        x = torch.randn(3, w.in_features, generator=torch.Generator().manual_seed(0))
        ref = x.double() @ w.dequantize().double().T
        rel = (quantized_matmul(x, w).double() - ref).norm() / ref.norm()
        assert rel < 0.01, (t.name, fmt, rel)
    assert {"Q5_0", "Q8_0", "Q4_K", "Q6_K"} <= seen, seen


def test_bad_quantization_settings(tmp_path):
    with pytest.raises(InvalidRequestError, match="one of auto, gguf, int8, none"):
        EngineConfig(quantization="int4")
    save_tiny_model("llama", tmp_path / "hf")
    with pytest.raises(ModelLoadError, match="needs a .gguf"):
        load(str(tmp_path / "hf"), "gguf")
    assert load(str(tmp_path / "hf"), "auto").model.layers[0].mlp.down_proj.quantized is None
    from kvserve.model.quantization import resolve_quantization
    with pytest.raises(ModelLoadError, match="int8 weights run on the CPU only"):
        resolve_quantization("int8", False, torch.device("cuda"))


# ----- int8 (W8A8): any checkpoint's linears quantized at load -----

def test_int8_blocks_are_the_bytes_llama_quantize_writes():
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    from kvserve.model.quantization import quantize_q8_0
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(0)) * torch.logspace(-4, 2, 40)[:, None]
    w[0, :32] = 0                                # a zero block: d = 0
    w[1, :32] = torch.arange(32) - 15.5          # halves: away from zero
    ours = quantize_q8_0(w)
    assert ours.format == "Q8_0" and ours.shape == (40, 96)
    assert np.array_equal(ours.data.numpy(), quantize(w.numpy(), GGMLQuantizationType.Q8_0).reshape(40, -1))


def test_q4_0_blocks_are_the_bytes_ggml_writes():
    # quantize_q4_0 (a speculative draft's requantized head) against gguf-py's port of quantize_row_q4_0_ref
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    from kvserve.model.quantization import quantize_q4_0
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(1)) * torch.logspace(-4, 2, 40)[:, None]
    w[0, :32] = 0                                # a zero block: d = 0
    w[1, :32] = torch.arange(32) - 16.0          # the largest |w| is negative: d > 0
    w[2, 32:64] = 3.0                            # ties for the largest |w|; w / d + 8.5 lands on whole numbers
    w[2, 40] = -3.0
    ours = quantize_q4_0(w)
    assert ours.format == "Q4_0" and ours.shape == (40, 96)
    assert np.array_equal(ours.data.numpy(), quantize(w.numpy(), GGMLQuantizationType.Q4_0).reshape(40, -1))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_int8_on_an_hf_checkpoint_matches_the_float_model(tmp_path, family):
    """Every linear, the output head and the embedding become INT8 (Qwen2's q/k/v biases added after);
    logits close to the float32 model's. Untied (llama) and tied (qwen2: the head multiplies the table's blocks)."""
    save_tiny_model(family, tmp_path / "hf", tie_word_embeddings=family == "qwen2")
    int8, dense = load(str(tmp_path / "hf"), "int8"), load(str(tmp_path / "hf"), "none")
    linears = [m for m in int8.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * 2 + (family == "llama")
    assert all(m.quantized.formats() == ["INT8"] and m.weight.is_meta for m in linears)
    embed = int8.model.embed_tokens
    assert embed.quantized.formats() == ["INT8"] and embed.quantized.source == "int8" and embed.weight.is_meta
    if family == "qwen2":
        assert int8.tied_head is embed.method
    assert (family == "qwen2") == (int8.model.layers[0].self_attn.qkv_proj.bias is not None)
    ids = [5, 9, 200, 31, 7, 77, 120, 3] * 3
    q, d = run_single_sequence(int8, ids), run_single_sequence(dense, ids)
    assert torch.nn.functional.cosine_similarity(q, d, dim=-1).min() > 0.999
    assert (q.argmax(-1) == d.argmax(-1)).float().mean() > 0.9   # a random model's logits have near-ties


@pytest.fixture(scope="module")
def int8_llm():
    return LLM(quantization="int8", dtype="float32", kv_cache_memory="96MiB", max_num_batched_tokens=INT8_STEP)


def test_int8_engine_perplexity_and_equivalences(int8_llm, dense_llm):
    engine = int8_llm.llm_engine
    assert engine.weights_summary.startswith("int8 W8A8 (INT8 x121): ")   # 120 linears and the tied table
    text = open(TEXT, encoding="utf-8").read()[:3000]   # two chunks of 256 tokens
    p8, pd = perplexity(int8_llm, text, 256), perplexity(dense_llm, text, 256)
    print(f"perplexity: int8 {p8['ppl']:.4f}, float32 {pd['ppl']:.4f}")
    assert abs(p8["ppl"] / pd["ppl"] - 1) < 0.02, (p8["ppl"], pd["ppl"])
    # rows are multiplied alone whatever shares their step
    alone = [greedy(int8_llm, [p], n=16)[0] for p in PROMPTS[:4]]
    assert greedy(int8_llm, PROMPTS[:4], n=16) == alone
