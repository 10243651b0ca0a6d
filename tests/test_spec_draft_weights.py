"""A speculative draft model's matrices in other formats than stored: its output matrix cut to its first rows and
any other rows (restrict_vocab, row_logits: draft_vocab_size), requantized to Q4_0 (draft_head_quantization), its
decoder layers requantized to Q4_0 (draft_quantization): ggml's bytes, the same logits, and the output of the
tiny pair (conftest.py) the same as without speculation."""
import dataclasses

import numpy as np
import pytest
import torch

from kvserve.errors import InvalidRequestError
from kvserve.model.layers import Linear
from kvserve.model.linear_method import QuantizedMethod

from model_utils import save_tiny_model
from spec_utils import GREEDY_30, STRESS, make_llm, tokens


def tiny_head_config(tmp_path, weights: str, tied: bool):
    """A tiny llama's EngineConfig with its weights as named (float32, bfloat16, Q8_0: a GGUF, int8), and its
    hidden size."""
    from kvserve.config import EngineConfig
    from model_utils import write_tiny_gguf
    hf = save_tiny_model("llama", tmp_path / "hf", tie_word_embeddings=tied)
    if weights == "Q8_0":
        return EngineConfig(model=str(write_tiny_gguf(tmp_path / "tiny.gguf", hf, qtype="Q8_0")), device="cpu"), \
            hf.config.hidden_size
    return EngineConfig(model=str(tmp_path / "hf"), device="cpu", tokenizer=str(tmp_path / "hf"),
                        dtype="float32" if weights == "int8" else weights,
                        quantization="int8" if weights == "int8" else "none"), hf.config.hidden_size


@pytest.mark.parametrize("weights", ["float32", "bfloat16", "Q8_0", "int8"])
@pytest.mark.parametrize("tied", [False, True])
def test_restricted_head_gives_the_first_columns_of_the_logits(tmp_path, weights, tied):
    from kvserve.model import load_model
    from kvserve.model.layers import release_unpacked_weights
    config, hidden_size = tiny_head_config(tmp_path, weights, tied)
    full_model, model = load_model(config)[0], load_model(config)[0]
    hidden = torch.randn(5, hidden_size, dtype=model.model.norm.weight.dtype)
    model.restrict_vocab(40)
    for m in (full_model, model):   # as the engine serves them: packed, plain copies released as they pack
        m.prepack(release=True)
        release_unpacked_weights(m)
    full, part = full_model.compute_logits(hidden), model.compute_logits(hidden, cut=True)
    cols = 48 if weights == "int8" else 40   # int8 rows come in groups of 16
    assert part.shape == (5, cols)
    assert torch.equal(model.compute_logits(hidden), full)   # the whole head stays
    if weights in ("Q8_0", "int8"):   # kept quantized: each column by the same kernel row
        assert model.cut_lm_head.quantized.formats() == ["Q8_0" if weights == "Q8_0" else "INT8"]
        assert torch.equal(part, full[:, :cols])
    else:
        torch.testing.assert_close(part, full[:, :cols], rtol=1e-5, atol=1e-5)
    # any rows: a cut draft's own ids past its cut (INT8: from their groups of 16)
    for ids in ((45, 60, 255), (41,), (3, 100, 101, 200)):
        rows = model.row_logits(hidden, ids)
        if weights in ("Q8_0", "int8"):
            assert torch.equal(rows, full[:, list(ids)])
        else:
            torch.testing.assert_close(rows, full[:, list(ids)], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="restrict_vocab"):
        model.restrict_vocab(257)
    with pytest.raises(ValueError, match="before restrict_vocab"):
        full_model.compute_logits(hidden, cut=True)
    with pytest.raises(ValueError, match="before restrict_vocab"):
        full_model.row_logits(hidden, (45,))


@pytest.mark.parametrize("weights", ["float32", "Q8_0", "int8"])
@pytest.mark.parametrize("tied", [False, True])
def test_head_requantized_to_q4_0_is_ggmls_q4_0_of_its_rows(tmp_path, weights, tied):
    # quantize_head_q4_0 (draft_head_quantization): the head's blocks are ggml's Q4_0 (gguf-py's quantizer) of the
    # stored head's rows, dequantized, and restrict_vocab's cut head its first rows; a tied model's embedding
    # lookups keep the table as stored
    import gguf
    from kvserve.model import load_model
    config, _ = tiny_head_config(tmp_path, weights, tied)
    model = load_model(config)[0]
    src = model.lm_head if model.lm_head is not None else model.model.embed_tokens
    stored = src.weight.detach().float() if src.quantized is None else src.quantized.dequantize()
    assert model.head_format() == {"float32": None, "Q8_0": "Q8_0", "int8": "INT8"}[weights]
    ids = torch.tensor([3, 17, 200])
    looked_up = model.model.embed_tokens(ids).clone()
    hidden = torch.randn(5, model.config.hidden_size, dtype=model.model.norm.weight.dtype)
    model.restrict_vocab(40)
    model.row_logits(hidden, (40, 77, 255))   # rows of the stored matrix, which must not outlive it
    model.quantize_head_q4_0()
    model.restrict_vocab(40)   # in Q4_0 now, an int8 head's cut is not rounded to its groups of 16
    assert model.head_format() == "Q4_0"
    rows = 40
    q4 = gguf.GGMLQuantizationType.Q4_0
    want = gguf.quants.dequantize(gguf.quants.quantize(stored.numpy(), q4), q4)
    assert np.array_equal(model.lm_head.quantized.dequantize().numpy(), want)
    assert np.array_equal(model.cut_lm_head.quantized.dequantize().numpy(), want[:rows])
    assert torch.equal(model.model.embed_tokens(ids), looked_up)
    model.prepack()
    logits = model.compute_logits(hidden)
    exact = hidden.double() @ torch.from_numpy(want).double().T
    assert logits.shape == (5, len(want)) and (logits.double() - exact).norm() < 0.02 * exact.norm()
    assert torch.equal(model.compute_logits(hidden, cut=True), logits[:, :rows])
    assert torch.equal(model.row_logits(hidden, (40, 77, 255)), logits[:, [40, 77, 255]])


def test_layer_formats_wider_than_q4_0():
    from kvserve.model.quantization import FORMAT_IDS, INT8, QuantizedTensor, is_wider_than_q4_0
    wider = {name for name, tid in FORMAT_IDS.items()
             if is_wider_than_q4_0(QuantizedTensor(tid, torch.empty(0, 0, dtype=torch.uint8), 256))}
    assert wider == {"Q4_1", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"}   # not Q4_0, Q4_K, IQ4_NL, IQ4_XS, Q3_K, Q2_K
    assert is_wider_than_q4_0(QuantizedTensor(INT8, torch.empty(0, 0, dtype=torch.uint8), 256))


@pytest.mark.parametrize("weights", ["float32", "Q8_0", "int8"])
def test_layers_requantized_to_q4_0_are_ggmls_q4_0_of_their_rows(tmp_path, weights):
    # quantize_layers_q4_0 (draft_quantization): every decoder-layer matrix stored in more bits a weight than Q4_0
    # becomes ggml's Q4_0 (gguf-py's quantizer) of its stored rows, dequantized; plain ones too unless stored_only;
    # a matrix of segments keeps those of Q4_0's size as they are
    import gguf
    from kvserve.model import load_model
    from kvserve.model.layers import Linear
    from kvserve.model.quantization import QuantizedWeight, to_q4_0
    config, _ = tiny_head_config(tmp_path, weights, tied=False)
    model = load_model(config)[0]
    linears = {name: m for name, m in model.model.layers.named_modules() if isinstance(m, Linear)}
    stored = {name: m.weight.detach().float() if m.quantized is None else m.quantized.dequantize()
              for name, m in linears.items()}
    head = model.lm_head.quantized
    if weights == "float32":
        assert model.quantize_layers_q4_0(stored_only=True) == {}
        assert all(m.quantized is None for m in linears.values())
    qkv = linears["0.self_attn.qkv_proj"]
    mixed = None
    if weights == "Q8_0":   # q|k|v as Q4_0 rows, then the Q8_0 rows: only the second segment is requantized
        part = qkv.quantized.segments[0]
        kept = to_q4_0(replace_rows(part, slice(0, 32)))
        mixed = QuantizedWeight([kept, replace_rows(part, slice(32, None))])
        qkv.method = QuantizedMethod(mixed)
        stored["0.self_attn.qkv_proj"] = mixed.dequantize()
        kept_bytes = mixed.segments[0].data.clone()
    replaced = model.quantize_layers_q4_0(stored_only=weights != "float32")
    want_format = {"float32": "plain", "Q8_0": "Q8_0", "int8": "INT8"}[weights]
    assert replaced == {want_format: len(linears)}
    q4 = gguf.GGMLQuantizationType.Q4_0
    for name, m in linears.items():
        assert m.weight.is_meta and m.quantized.formats() == ["Q4_0"] * len(m.quantized.segments)
        want = gguf.quants.dequantize(gguf.quants.quantize(stored[name].numpy(), q4), q4)
        assert np.array_equal(m.quantized.dequantize().numpy(), want), name
    if mixed is not None:
        assert len(qkv.quantized.segments) == 2 and torch.equal(qkv.quantized.segments[0].data, kept_bytes)
    assert model.lm_head.quantized is head   # the head is draft_head_quantization's
    assert model.quantize_layers_q4_0(stored_only=False) == {}   # nothing left to requantize


def replace_rows(part, rows: slice):
    """A QuantizedTensor of some of `part`'s rows (in the kernels' order, as it is)."""
    return dataclasses.replace(part, data=part.data[rows].contiguous())


@pytest.fixture(scope="module")
def q8_draft(tiny_pair, tmp_path_factory):
    """The tiny pair's draft as a Q8_0 GGUF (head and layers in Q8_0): its path."""
    from transformers import AutoModelForCausalLM
    from model_utils import write_tiny_gguf
    hf_draft = AutoModelForCausalLM.from_pretrained(tiny_pair[1])
    hf_draft.config.head_dim = hf_draft.config.hidden_size // hf_draft.config.num_attention_heads
    return str(write_tiny_gguf(tmp_path_factory.mktemp("q8") / "draft.gguf", hf_draft, arch="qwen2", qtype="Q8_0"))


def test_draft_head_in_q4_0_keeps_the_output(tiny_pair, q8_draft, greedy_reference, gguf_path, tmp_path):
    # draft_head_quantization: "q4_0" requantizes a dense draft's head, "auto" a Q8_0 GGUF draft's and leaves a
    # dense one's, null keeps the Q8_0 one; the output stays the target's. A hidden size that Q4_0's blocks of 32
    # do not divide is refused at start, and so is "q4_0" without the C++ kernels
    (target, draft), q8 = tiny_pair, q8_draft
    (prompts, want), params = greedy_reference, GREEDY_30
    for path, setting, fmt in [(draft, "q4_0", "Q4_0"), (draft, "auto", None), (q8, "auto", "Q4_0"),
                               (q8, None, "Q8_0")]:
        spec = {"model": path, "num_speculative_tokens": 4, "disable_by_batch_size": None,
                "draft_head_quantization": setting}
        llm = make_llm(spec, model=target, tokenizer=gguf_path)
        assert llm.llm_engine.runner.draft_model.head_format() == fmt
        assert tokens(llm.generate(prompts, params, use_tqdm=False)) == want
        assert llm.llm_engine.scheduler.spec_stats.num_accepted_tokens > 0
    # a cut vocabulary is cut from the requantized head
    spec = {"model": q8, "num_speculative_tokens": 4, "draft_vocab_size": 48}
    cut_head = make_llm(spec, model=target, tokenizer=gguf_path).llm_engine.runner.draft_model.cut_lm_head
    assert cut_head.quantized.formats() == ["Q4_0"] and cut_head.weight.shape[0] == 48
    save_tiny_model("qwen2", tmp_path / "narrow", num_hidden_layers=1, vocab_size=96, hidden_size=48)
    with pytest.raises(InvalidRequestError, match="hidden size 48 is not a multiple of 32"):
        make_llm({"model": str(tmp_path / "narrow"), "num_speculative_tokens": 2, "draft_head_quantization": "q4_0"},
                 model=target, tokenizer=gguf_path)
    from kvserve import kernels
    with kernels.variant("none"), pytest.raises(InvalidRequestError, match="needs the CPU and its C\\+\\+ kernels"):
        make_llm({"model": draft, "num_speculative_tokens": 2, "draft_head_quantization": "q4_0"}, model=target,
                 tokenizer=gguf_path)


def test_draft_layers_in_q4_0_keep_the_output(tiny_pair, q8_draft, greedy_reference, gguf_path, tmp_path):
    # draft_quantization: "auto" requantizes a Q8_0 GGUF draft's layers and leaves a dense one's, "q4_0" a dense
    # one's too, null keeps them; the output stays the target's, batched and chunked/preempted/cached. An input
    # size that Q4_0's blocks of 32 do not divide is refused at start for "q4_0", and so is "q4_0" without the
    # C++ kernels
    (target, draft), q8 = tiny_pair, q8_draft
    (prompts, want), params = greedy_reference, GREEDY_30
    for path, setting, fmt, config in [(draft, "q4_0", "Q4_0", STRESS), (draft, "auto", None, {}),
                                       (q8, "auto", "Q4_0", {}), (q8, "auto", "Q4_0", STRESS), (q8, None, "Q8_0", {})]:
        spec = {"model": path, "num_speculative_tokens": 4, "disable_by_batch_size": None,
                "draft_quantization": setting}
        llm = make_llm(spec, model=target, tokenizer=gguf_path, **config)
        linears = [m for m in llm.llm_engine.runner.draft_model.model.layers.modules() if isinstance(m, Linear)]
        assert {None if m.quantized is None else "+".join(m.quantized.formats()) for m in linears} == {fmt}
        assert tokens(llm.generate(prompts, params, use_tqdm=False)) == want
        assert llm.llm_engine.scheduler.spec_stats.num_accepted_tokens > 0
    save_tiny_model("qwen2", tmp_path / "narrow", num_hidden_layers=1, vocab_size=96, hidden_size=48)
    with pytest.raises(InvalidRequestError, match="draft_quantization q4_0: an input size .* not a multiple of 32"):
        make_llm({"model": str(tmp_path / "narrow"), "num_speculative_tokens": 2, "draft_quantization": "q4_0",
                  "draft_head_quantization": None}, model=target, tokenizer=gguf_path)
    from kvserve import kernels
    with kernels.variant("none"):
        with pytest.raises(InvalidRequestError, match="needs the CPU and its C\\+\\+ kernels"):
            make_llm({"model": draft, "num_speculative_tokens": 2, "draft_quantization": "q4_0"}, model=target,
                     tokenizer=gguf_path)
        # "auto" (the default) on a dense draft has nothing to requantize: it starts without the kernels too
        llm = make_llm({"model": draft, "num_speculative_tokens": 2}, model=target, tokenizer=gguf_path)
        assert tokens(llm.generate(prompts[:2], params, use_tqdm=False)) == want[:2]
