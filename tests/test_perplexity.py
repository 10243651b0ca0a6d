"""The bundled model's perplexity over the GPL text (`kvserve bench perplexity`, llama-perplexity's chunks of 512)
with its GGUF weights kept quantized, and with FP8 KV pools whose scales it calibrates, each against the same
model dequantized on unquantized pools: one dense run the two compare with. In the serving dtype (auto: bf16 where
the CPU has its kernels), each chunk in one step."""
from pathlib import Path

import pytest

from kvserve import LLM
from kvserve.entrypoints.perplexity import perplexity
from kvserve.errors import InvalidRequestError

# eight chunks: with two or four the quantized ratio swings by ~0.5% with how the engine chunks them (+1.0-1.3%)
TEXT = (Path(__file__).parent / "data" / "gpl-3.0.txt").read_text(encoding="utf-8")[:20000]


@pytest.fixture(scope="module")
def dense():
    """The dequantized model's perplexity on unquantized pools."""
    result = perplexity(LLM(quantization="none", dtype="auto", kv_cache_memory="96MiB"), TEXT, 512)
    assert result["num_chunks"] == 8 and result["num_scored_tokens"] == 8 * 255
    return result


def test_kept_quantized_weights_within_one_percent_of_the_dequantized_model(dense):
    quantized_llm = LLM(quantization="gguf", dtype="auto", kv_cache_memory="96MiB")
    pq = perplexity(quantized_llm, TEXT, 512)
    assert pq["num_chunks"] == 8 and pq["num_scored_tokens"] == 8 * 255
    assert abs(pq["ppl"] / dense["ppl"] - 1) < 0.01, (pq["ppl"], dense["ppl"])
    with pytest.raises(InvalidRequestError, match="at least 2"):   # as llama-perplexity: two chunks at least
        perplexity(quantized_llm, TEXT[:3000], 512)


def test_calibrated_fp8_pools_within_two_percent_of_the_unquantized_cache(dense):
    """As `kvserve bench perplexity --kv-cache-dtype fp8 --calculate-kv-scales` runs it: the scales come from the
    first step, two whole chunks of the text (a pool of 24 MiB)."""
    calibrated = LLM(quantization="none", dtype="auto", kv_cache_dtype="fp8", calculate_kv_scales=True,
                     kv_cache_memory="24MiB")
    p8 = perplexity(calibrated, TEXT, 512)
    print(f"perplexity: fp8 KV {p8['ppl']:.4f}, {calibrated.llm_engine.dtype} KV {dense['ppl']:.4f}")
    assert p8["num_chunks"] == 8 and abs(p8["ppl"] / dense["ppl"] - 1) < 0.02, (p8["ppl"], dense["ppl"])
