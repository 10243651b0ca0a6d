"""Speculative decoding with a draft model: on a random tiny target and a draft made of its first layer, the output
equals the output without speculation (batched, chunked, preempted, prefix-cached, seeded sampling), drafts drawn
from the draft's distribution keep the target's, the draft's KV stays right through accepted and rejected drafts;
its head cut to the first token ids (draft_vocab_size) or requantized to Q4_0 (draft_head_quantization); drafts
refused at start unless they share the vocabulary and are smaller."""
import copy
import dataclasses

import numpy as np
import pytest
import torch

from kvserve import SamplingParams
from kvserve.errors import InvalidRequestError

from model_utils import save_tiny_model
from spec_utils import GREEDY, STRESS, make_llm, save_first_layer_draft, tiny_prompts, tokens


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    save_tiny_model("qwen2", root / "target", num_hidden_layers=3, vocab_size=96)
    save_first_layer_draft(root / "target", root / "draft")
    return str(root / "target"), str(root / "draft")


GREEDY_30 = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def greedy_reference(tiny_pair, gguf_path):
    """tiny_prompts() and the tiny target's greedy output for them (GREEDY_30) without speculation."""
    prompts = tiny_prompts()
    return prompts, tokens(make_llm(model=tiny_pair[0], tokenizer=gguf_path).generate(prompts, GREEDY_30,
                                                                                      use_tqdm=False))


@pytest.mark.parametrize("config", [{}, STRESS], ids=["batched", "chunked-preempted-cached"])
def test_draft_model_greedy_equals_no_speculation(tiny_pair, greedy_reference, gguf_path, config):
    target, draft = tiny_pair
    (prompts, want), params = greedy_reference, GREEDY_30
    spec = {"model": draft, "num_speculative_tokens": 4, "disable_by_batch_size": None}
    llm = make_llm(spec, model=target, tokenizer=gguf_path, **config)
    got = tokens(llm.generate(prompts + prompts, params, use_tqdm=False))
    assert got == want + want
    stats = llm.llm_engine.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    if config:
        assert llm.llm_engine.scheduler.num_preemptions > 0
        for _ in range(2):   # the second time from the prefix cache
            assert tokens(llm.generate(prompts[-1:], params, use_tqdm=False)) == want[-1:]
        assert llm.llm_engine.scheduler.prefix_cache_hits > 0
    seeded = SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=30, ignore_eos=True)
    assert tokens(llm.generate(prompts, seeded, use_tqdm=False)) == \
        tokens(make_llm(model=target, tokenizer=gguf_path).generate(prompts, seeded, use_tqdm=False))


def vocab_rule(prompt: list[int], out: list[int], cut: int = 48) -> tuple[set[int], bool]:
    """The request's own ids past the cut (its prompt's and output's), and whether it drafts from the whole
    vocabulary: once 2 of its output tokens, and 1 in 32 of them, were past the cut and new to it."""
    own, new = {t for t in prompt if t >= cut}, 0
    for t in out:
        if t >= cut and t not in own:
            own.add(t)
            new += 1
    return own, new >= 2 and 32 * new >= len(out)


@pytest.mark.parametrize("config", [{}, STRESS], ids=["batched", "chunked-preempted-cached"])
def test_draft_vocabulary_of_its_first_ids_keeps_the_output(tiny_pair, greedy_reference, gguf_path, config):
    # the draft proposes among ids < 48 and the request's own ids past them, but from the whole vocabulary for a
    # request whose output brings new ids past the cut (vocab_rule)
    target, draft = tiny_pair
    (prompts, want), params = greedy_reference, GREEDY_30
    assert any(t >= 48 for req in want for seq in req for t in seq)   # ids the cut draft cannot propose
    spec = {"model": draft, "num_speculative_tokens": 4, "disable_by_batch_size": None, "draft_vocab_size": 48}
    llm = make_llm(spec, model=target, tokenizer=gguf_path, **config)
    runner, proposals, batches = llm.llm_engine.runner, [], []
    propose = runner.propose_drafts

    def recording(reqs, max_drafts):
        rules = [vocab_rule(req.prompt_token_ids, list(req.output_token_ids)) for req in reqs]
        try:
            drafts = propose(reqs, max_drafts)
        except Exception as e:   # the engine would go on without drafts: the output alone would not show it
            batches.append(e)
            raise
        proposals.extend(zip(rules, drafts))
        batches.append({whole for (_, whole), d in zip(rules, drafts) if d})
        return drafts
    runner.propose_drafts = recording
    assert tokens(llm.generate(prompts + prompts, params, use_tqdm=False)) == want + want
    if config:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    assert all(isinstance(b, set) for b in batches) and {False, True} in batches   # a batch of both kinds
    cut = [(own, d) for (own, whole), d in proposals if d and not whole]
    whole = [(own, d) for (own, whole), d in proposals if d and whole]
    assert cut and all(t < 48 or t in own for own, d in cut for t in d)
    assert any(t >= 48 for _, d in cut for t in d)   # the request's own ids past the cut are proposed
    assert any(t >= 48 and t not in own for own, d in whole for t in d)   # the whole head's proposals
    assert llm.llm_engine.scheduler.spec_stats.num_accepted_tokens > 0
    with pytest.raises(InvalidRequestError, match="exceeds the vocabulary"):
        make_llm({**spec, "draft_vocab_size": 97}, model=target, tokenizer=gguf_path)


def test_a_request_drafts_from_the_whole_vocabulary_while_its_output_brings_new_ids_past_the_cut(tiny_pair,
                                                                                               gguf_path):
    from kvserve.core.request import Request
    target, draft = tiny_pair
    spec = {"model": draft, "num_speculative_tokens": 2, "draft_vocab_size": 48}
    runner = make_llm(spec, model=target, tokenizer=gguf_path).llm_engine.runner
    req = Request("r", [1, 2, 3, 80, 80, 90], SamplingParams(max_tokens=200))
    seen = []
    for out in ([5, 60], [5, 60, 80, 90], [5, 60, 80, 90, 70], [5, 60], [5, 60, 70] + [7] * 61,
                [5, 60, 70] + [7] * 62, [5, 60, 70], [60, 60]):
        del req.output_token_ids[:]   # also as tokens past a stop string are dropped
        req.output_token_ids.extend(out)
        vocab = runner._draft_vocab(req)
        seen.append(None if vocab is None else sorted(vocab.own))
    # 60 is new, 80 and 90 the prompt's: no; 60 and 70 new, 2 of 5 (1 in 32): yes; cut back: no; 2 of 64: yes;
    # 2 of 65: no; cut back, counted again from the prompt: yes; a new id repeated counts once: no
    own = [60, 80, 90]
    assert seen == [own, own, None, own, None, [60, 70, 80, 90], None, own]
    # a batch of three: the whole matrix's row; the cut's and the request's own rows, -inf elsewhere
    from kvserve.spec_decode.draft_vocab import DraftVocab, draft_logits
    model = runner.draft_model
    hidden = torch.randn(3, model.config.hidden_size, dtype=model.model.norm.weight.dtype)
    a, b = DraftVocab([1, 50, 60], 48), DraftVocab([2, 60, 95], 48)
    mixed = draft_logits(model, hidden, [a, None, b])
    whole, cut = model.compute_logits(hidden), model.compute_logits(hidden, cut=True)
    assert mixed.shape == (3, 96) and cut.shape == (3, 48)
    torch.testing.assert_close(mixed[1], whole[1], rtol=1e-5, atol=1e-5)
    for row, ids in ((0, [50, 60]), (2, [60, 95])):
        torch.testing.assert_close(mixed[row, :48], cut[row], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mixed[row, ids], whole[row, ids], rtol=1e-5, atol=1e-5)
        rest = [t for t in range(48, 96) if t not in ids]
        assert torch.all(mixed[row, rest] == -torch.inf)
    assert draft_logits(model, hidden, [DraftVocab([1], 48)] * 3).shape == (3, 48)   # nothing past the cut
    alone = draft_logits(model, hidden[2:], [b])   # a request alone: its own ids, no mask needed
    torch.testing.assert_close(alone[0, [60, 95]], mixed[2, [60, 95]], rtol=1e-5, atol=1e-5)
    assert torch.all(alone[0, [50, 70]] == -torch.inf)


def test_draft_vocabulary_auto_cuts_large_vocabularies_only(tiny_pair, gguf_path):
    # "auto" (the default) cuts a vocabulary of more than 65536 tokens to its first 32768; the tiny pair's 96 stay
    from kvserve.spec_decode.config import auto_draft_vocab
    assert [auto_draft_vocab(n) for n in (96, 65536, 65537, 151936)] == [None, None, 32768, 32768]
    target, draft = tiny_pair
    llm = make_llm({"model": draft, "num_speculative_tokens": 2}, model=target, tokenizer=gguf_path)
    assert llm.llm_engine.spec_config.draft_vocab_size == "auto"
    assert llm.llm_engine.runner.draft_model.cut_lm_head is None


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
    for m in (full_model, model):   # as the engine serves them: packed, plain copies released
        m.prepack()
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
    hidden = torch.randn(5, model.config.hidden_size, dtype=model.model.norm.weight.dtype)
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
        qkv.packed.quant = mixed
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


def test_draft_head_in_q4_0_keeps_the_output(tiny_pair, greedy_reference, gguf_path, tmp_path):
    # draft_head_quantization: "q4_0" requantizes a dense draft's head, "auto" a Q8_0 GGUF draft's and leaves a
    # dense one's, null keeps the Q8_0 one; the output stays the target's. A hidden size that Q4_0's blocks of 32
    # do not divide is refused at start, and so is "q4_0" without the C++ kernels
    from transformers import AutoModelForCausalLM
    from model_utils import write_tiny_gguf
    target, draft = tiny_pair
    hf_draft = AutoModelForCausalLM.from_pretrained(draft)
    hf_draft.config.head_dim = hf_draft.config.hidden_size // hf_draft.config.num_attention_heads
    q8 = str(write_tiny_gguf(tmp_path / "draft.gguf", hf_draft, arch="qwen2", qtype="Q8_0"))
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


def test_draft_layers_in_q4_0_keep_the_output(tiny_pair, greedy_reference, gguf_path, tmp_path):
    # draft_quantization: "auto" requantizes a Q8_0 GGUF draft's layers and leaves a dense one's, "q4_0" a dense
    # one's too, null keeps them; the output stays the target's, batched and chunked/preempted/cached. An input
    # size that Q4_0's blocks of 32 do not divide is refused at start for "q4_0", and so is "q4_0" without the
    # C++ kernels
    from transformers import AutoModelForCausalLM
    from model_utils import write_tiny_gguf
    target, draft = tiny_pair
    hf_draft = AutoModelForCausalLM.from_pretrained(draft)
    hf_draft.config.head_dim = hf_draft.config.hidden_size // hf_draft.config.num_attention_heads
    q8 = str(write_tiny_gguf(tmp_path / "draft.gguf", hf_draft, arch="qwen2", qtype="Q8_0"))
    (prompts, want), params = greedy_reference, GREEDY_30
    for path, setting, fmt, config in [(draft, "q4_0", "Q4_0", STRESS), (draft, "auto", None, {}),
                                       (q8, "auto", "Q4_0", {}), (q8, "auto", "Q4_0", STRESS), (q8, None, "Q8_0", {})]:
        spec = {"model": path, "num_speculative_tokens": 4, "disable_by_batch_size": None,
                "draft_quantization": setting}
        llm = make_llm(spec, model=target, tokenizer=gguf_path, **config)
        down = llm.llm_engine.runner.draft_model.model.layers[0].mlp.down_proj
        assert (down.quantized.formats() if down.quantized is not None else None) == (fmt and [fmt])
        assert tokens(llm.generate(prompts, params, use_tqdm=False)) == want
        assert llm.llm_engine.scheduler.spec_stats.num_accepted_tokens > 0
    save_tiny_model("qwen2", tmp_path / "narrow", num_hidden_layers=1, vocab_size=96, hidden_size=48)
    with pytest.raises(InvalidRequestError, match="draft_quantization q4_0: an input size .* not a multiple of 32"):
        make_llm({"model": str(tmp_path / "narrow"), "num_speculative_tokens": 2, "draft_quantization": "q4_0",
                  "draft_head_quantization": None}, model=target, tokenizer=gguf_path)
    from kvserve import kernels
    with kernels.variant("none"), pytest.raises(InvalidRequestError, match="needs the CPU and its C\\+\\+ kernels"):
        make_llm({"model": draft, "num_speculative_tokens": 2, "draft_quantization": "q4_0"}, model=target,
                 tokenizer=gguf_path)


def two_sample_chi_square(a: list[int], b: list[int]) -> tuple[float, float]:
    """(statistic, its 99.9% quantile) for 'a and b, as many draws each, come from one distribution'; bins of
    under 10 draws merged."""
    assert len(a) == len(b)
    ca, cb = np.bincount(a, minlength=96), np.bincount(b, minlength=96)
    small = ca + cb < 10
    ca, cb = np.append(ca[~small], ca[small].sum()), np.append(cb[~small], cb[small].sum())
    keep = ca + cb > 0
    ca, cb = ca[keep], cb[keep]
    dof = len(ca) - 1
    quantile = dof * (1 - 2 / (9 * dof) + 3.09 * np.sqrt(2 / (9 * dof))) ** 3   # Wilson-Hilferty
    return float(((ca - cb) ** 2 / (ca + cb)).sum()), quantile


@pytest.mark.parametrize("vocab", [None, 48], ids=["whole", "cut"])
def test_drafts_drawn_from_the_draft_distribution_keep_the_targets(tmp_path, gguf_path, vocab):
    # random requests without a seed draw their drafts from the draft's q (temperature, top-p and a penalty
    # applied) and keep each with probability min(1, p/q): the tokens after the first, which verifications emit,
    # are distributed as without speculation (two-sample chi-square at each of positions 1 to 3). Weights of a
    # larger scale than tiny_pair's give distributions far from uniform, where a wrong q shows. With a cut
    # vocabulary q is zero past the cut for requests that draft from it, in batches with whole ones.
    save_tiny_model("qwen2", tmp_path / "target", num_hidden_layers=3, vocab_size=96, initializer_range=0.25)
    save_first_layer_draft(tmp_path / "target", tmp_path / "draft")
    target, draft = str(tmp_path / "target"), str(tmp_path / "draft")
    params = SamplingParams(temperature=0.5, top_p=0.95, presence_penalty=0.5, max_tokens=4, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 33, 8, 61]}] * 3000
    off = make_llm(model=target, tokenizer=gguf_path)
    llm = make_llm({"model": draft, "num_speculative_tokens": 3, "disable_by_batch_size": None,
                    "draft_vocab_size": vocab}, model=target, tokenizer=gguf_path)
    runner, drawn = llm.llm_engine.runner, []
    propose = runner.propose_drafts

    def recording(reqs, max_drafts):
        drafts = propose(reqs, max_drafts)
        drawn.extend(r.spec_draft_probs is not None for r, d in zip(reqs, drafts) if d)
        return drafts
    runner.propose_drafts = recording
    got = [t[0] for t in tokens(llm.generate(prompts, params, use_tqdm=False))]
    want = [t[0] for t in tokens(off.generate(prompts, params, use_tqdm=False))]
    assert drawn and all(drawn)
    stats = llm.llm_engine.scheduler.spec_stats
    assert 0.05 * stats.num_draft_tokens < stats.num_accepted_tokens < 0.9 * stats.num_draft_tokens
    for pos in range(1, 4):
        statistic, quantile = two_sample_chi_square([t[pos] for t in got], [t[pos] for t in want])
        assert statistic < quantile, (pos, statistic, quantile)


def test_the_memory_profile_samples_the_largest_step_with_drawn_drafts(tiny_pair, gguf_path, monkeypatch):
    # the GPU's KV budget is what a profiled step leaves: it samples max_num_seqs * (k + 1) rows (fewer if the
    # token budget is smaller, or if fewer requests may draft) and verifies drafts drawn from q on every row but
    # each sequence's bonus row
    from kvserve.sample import sampler
    target, draft = tiny_pair
    llm = make_llm({"model": draft, "num_speculative_tokens": 3}, model=target, tokenizer=gguf_path, max_num_seqs=4)
    verified, verify = [], sampler.verify_sampled_drafts

    def recording(probs, u, meta):
        verified.append(meta.sampled_drafts.rows.tolist())
        return verify(probs, u, meta)
    monkeypatch.setattr(sampler, "verify_sampled_drafts", recording)
    engine = llm.llm_engine
    assert engine.runner.profile_step(engine.config, 64) == 16
    assert engine.runner.profile_step(engine.config, 10) == 10
    # drafts only while at most disable_by_batch_size requests run: 2 of them with 4 rows, or 4 with one
    spec = dataclasses.replace(engine.config.speculative_config, disable_by_batch_size=2)
    assert engine.runner.profile_step(dataclasses.replace(engine.config, speculative_config=spec), 64) == 8
    assert verified == [[r for r in range(n) if r % 4 != 3] for n in (16, 10, 8)]
    assert llm.generate(tiny_prompts(1), GREEDY, use_tqdm=False)[0].outputs[0].token_ids   # serving goes on


def test_draft_model_must_share_the_vocabulary_and_be_smaller(tiny_pair, gguf_path, tmp_path):
    target, draft = tiny_pair
    save_tiny_model("qwen2", tmp_path / "other_vocab", num_hidden_layers=1, vocab_size=128)
    with pytest.raises(InvalidRequestError, match="vocabulary has 128 tokens, the target's 96"):
        make_llm({"model": str(tmp_path / "other_vocab"), "num_speculative_tokens": 2}, model=target,
                 tokenizer=gguf_path)
    with pytest.raises(InvalidRequestError, match="is not smaller than the target"):
        make_llm({"model": target, "num_speculative_tokens": 2}, model=draft, tokenizer=gguf_path)
    with pytest.raises(InvalidRequestError, match="could not be loaded"):
        make_llm({"model": str(tmp_path / "missing"), "num_speculative_tokens": 2}, model=target,
                 tokenizer=gguf_path)


class RowCounter:
    """A model that counts the rows it runs; every other attribute is the model's own."""

    def __init__(self, model):
        self.model, self.num_rows = model, 0

    def __call__(self, input_ids, positions, meta):
        self.num_rows += input_ids.numel()
        return self.model(input_ids, positions, meta)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_the_draft_skips_what_its_proposal_wrote_and_keeps_a_right_kv(tmp_path, gguf_path):
    """The draft is the target's first layer, so at every computed position its KV must equal the target's first
    layer's, through accepted and rejected drafts alike (a row the draft skipped that its proposal did not write
    would not); verification steps run the draft on no row (the last draft of a verification that accepted all k
    rides with the next proposal's first draft forward)."""
    from kvserve.attention import attention_layers
    target = save_tiny_model("qwen2", tmp_path / "target", num_hidden_layers=2, vocab_size=96)
    with torch.no_grad():   # a faint second layer: most drafts are accepted, some are not
        for linear in (target.model.layers[1].self_attn.o_proj, target.model.layers[1].mlp.down_proj):
            linear.weight.mul_(0.05)
    target.save_pretrained(tmp_path / "target")
    save_first_layer_draft(tmp_path / "target", tmp_path / "draft")
    spec = {"model": str(tmp_path / "draft"), "num_speculative_tokens": 4, "disable_by_batch_size": None}
    engine = make_llm(spec, model=str(tmp_path / "target"), tokenizer=gguf_path).llm_engine
    runner = engine.runner
    target_kv, draft_kv = attention_layers(runner.model)[0], attention_layers(runner.draft_model)[0]
    runner.model, runner.draft_model = RowCounter(runner.model), RowCounter(runner.draft_model)
    propose, proposal_rows = runner.propose_drafts, []

    def counted_propose(reqs, max_drafts):
        before = runner.draft_model.num_rows
        out = propose(reqs, max_drafts)
        proposal_rows.append(runner.draft_model.num_rows - before)
        return out

    runner.propose_drafts = counted_propose
    prompts = tiny_prompts(3)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    bs = engine.block_size

    def check_draft_kv():
        for i in range(len(prompts)):
            req = engine.scheduler.requests[str(i)]
            pos = torch.arange(req.num_computed_tokens)
            slots = torch.tensor(engine.kv.get_block_ids(str(i)))[pos // bs] * bs + pos % bs
            for t, d in ((target_kv.k_cache, draft_kv.k_cache), (target_kv.v_cache, draft_kv.v_cache)):
                torch.testing.assert_close(d.flatten(0, 1)[slots], t.flatten(0, 1)[slots], atol=1e-5, rtol=1e-5)

    for _ in range(8):
        engine.step()
    check_draft_kv()
    stats = copy.deepcopy(engine.scheduler.spec_stats)
    draft_rows, target_rows = runner.draft_model.num_rows, runner.model.num_rows
    # proposals off: the next step verifies the last ones; a request that accepted all its drafts lacks the last
    # one's draft KV, which the decode after writes with its own token
    engine.spec_config.disable_by_batch_size = 0
    engine.step()
    reqs = [engine.scheduler.requests[str(i)] for i in range(len(prompts))]
    assert any(req.draft_kv_end < req.num_computed_tokens for req in reqs)
    # a block whose draft KV is not all written yet is not registered in the prefix cache
    assert engine.kv.enable_caching
    assert all(engine.kv.num_cached_blocks.get(req.request_id, 0) * bs <= req.draft_kv_end for req in reqs)
    for _ in range(2):
        engine.step()
    check_draft_kv()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens   # both paths ran
    verify_rows = draft_rows - sum(proposal_rows)
    prompt_rows = sum(len(p["prompt_token_ids"]) for p in prompts)
    assert verify_rows == prompt_rows and stats.num_drafts < (target_rows - prompt_rows) / 3
    # each proposal's draft forwards: k rows per request, and one more after each verification that accepted all
    all_accepted = stats.num_accepted_per_pos[3]
    assert all_accepted > 0 and sum(proposal_rows) == 4 * len(prompts) * len(proposal_rows) + all_accepted
