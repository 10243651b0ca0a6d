"""fp16 checkpoints on the CPUs whose bf16 matmuls widen their weights (AVX2, AVX-512 without BF16): under
dtype="auto" the linears keep their fp16 weights, exactly, packed for the F16C matmul (PackedF16Method), with bf16
activations; the fused layer stack runs them bit-identical to the modules, in both builds; the engine serves them
closer to transformers in float32 than the same checkpoint rounded to bf16. Each build is run where the CPU has
more (kernel variants)."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams, kernels
from kvserve.attention.backends import CpuPagedAttention
from kvserve.config import EngineConfig
from kvserve.model.layers import Linear
from kvserve.model.linear_method import PackedF16Method
from kvserve.model.loader import load_model
from model_utils import save_tiny_model
from test_fused_layers import _run_steps

NAMES = kernels.distinct_builds(("no-avx512", "no-avx512bf16"))
pytestmark = pytest.mark.skipif(
    not any(lib is not None and lib.kvserve_has_packed_matmul_f16() for lib in map(kernels.load_variant, NAMES)),
    reason="no build here widens fp16 weights (the C++ kernels with AVX2 and F16C)")


def _save_fp16(root, family: str, tied: bool):
    hf = save_tiny_model(family, root / "f32", vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, tie_word_embeddings=tied)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.mul_(3.0)   # wider logits: the tokens are not all ties
    hf.half().save_pretrained(str(root / "f16"))
    return str(root / "f16"), hf.float()


@pytest.fixture(scope="module")
def fp16_checkpoint(tmp_path_factory):
    """A tiny tied llama saved in fp16, and transformers' float32 model on the same (fp16-rounded) weights."""
    return _save_fp16(tmp_path_factory.mktemp("fp16"), "llama", tied=True)


def _load(path: str, dtype: str = "auto", **kwargs):
    model, _ = load_model(EngineConfig(model=path, dtype=dtype, device="cpu"), **kwargs)
    model.prepack()
    return model


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_linears_keep_their_fp16_weights_and_the_stack_runs_them(tmp_path, family):
    """A tied llama (its table is its head) and an untied qwen2 with biases (its own bf16 table)."""
    tied = family == "llama"
    path, hf = _save_fp16(tmp_path, family, tied)
    runs = {}
    for name in NAMES:
        with kernels.variant(name) as lib:
            backend = CpuPagedAttention(lib)   # this build's attention (the default one is the process's first)
            model = _load(path)
            assert "fp16 checkpoint's linears kept in fp16" in model.dtype_reason
            assert model.activation_dtype == torch.bfloat16
            linears = [m for m in model.modules() if isinstance(m, Linear)]
            assert linears and all(isinstance(m.method, PackedF16Method) for m in linears)
            embed = model.model.embed_tokens
            ids = torch.tensor([0, 5, 17, 255, 5])
            assert isinstance(embed.method, PackedF16Method) == tied   # tied: the head's pack, whose rows it reads
            assert torch.equal(embed(ids), hf.model.embed_tokens.weight[ids].to(torch.bfloat16))
            want = hf.model.layers[0].mlp.down_proj.weight.half()
            assert torch.equal(model.model.layers[0].mlp.down_proj.method.unpack(want.shape[1]), want)   # exact
            fused, fused_pools = _run_steps(model, 16, backend)
            assert model.model._fused is not None
            model.model.use_fused_layers = False
            modules, module_pools = _run_steps(model, 16, backend)
            assert all(torch.equal(a, b) for a, b in zip(fused + fused_pools, modules + module_pools))
            rounded = _load(path, "bfloat16")   # the same checkpoint rounded to bf16: other logits
            assert not all(isinstance(m.method, PackedF16Method) for m in rounded.modules() if isinstance(m, Linear))
            assert not torch.equal(_run_steps(rounded, 16, backend)[0][-1], fused[-1])
            draft = _load(path, fp16_linears=False)   # a draft model: its heads are rebuilt from plain weights
            assert "rounded to bf16" in draft.dtype_reason
            assert not any(isinstance(m.method, PackedF16Method) for m in draft.modules() if isinstance(m, Linear))
        runs[name] = fused
    assert all(torch.equal(a, b) for a, b in zip(runs[NAMES[0]], runs[NAMES[-1]]))   # the two builds: same bits


def test_the_engine_serves_them_closer_to_float32_than_bf16_weights(fp16_checkpoint, gguf_path):
    """Prompt logprobs against transformers in float32 on the fp16 weights: the fp16 weights kept give a smaller
    error than the same run on weights rounded to bf16 (dtype="bfloat16"), and greedy decoding runs."""
    path, hf = fp16_checkpoint
    prompt = torch.randint(3, 250, (1, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = torch.log_softmax(hf(prompt, attention_mask=torch.ones_like(prompt)).logits[0].float(), -1)
    want = ref[torch.arange(99), prompt[0, 1:]]
    errors = {}
    with kernels.variant(NAMES[-1]):
        for dtype in ("auto", "bfloat16"):
            llm = LLM(model=path, tokenizer=gguf_path, dtype=dtype, num_kv_blocks=64, max_num_seqs=2,
                      max_model_len=128)
            engine = llm.llm_engine
            assert engine.dtype == torch.bfloat16
            assert ("matrices in fp16" in engine.weights_summary) == (dtype == "auto")
            out = llm.generate({"prompt_token_ids": prompt[0].tolist()},
                               SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=0),
                               use_tqdm=False)[0]
            got = torch.tensor([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])
            errors[dtype] = (got - want).abs().mean().item()
            assert len(out.outputs[0].token_ids) == 8
    assert errors["auto"] < errors["bfloat16"] < 0.05, errors
