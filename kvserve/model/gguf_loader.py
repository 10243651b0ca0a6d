"""GGUF checkpoints: metadata -> ModelConfig, and dequantized tensors under HF names in HF layout."""
from __future__ import annotations

import collections
import functools
import mmap
import os
import re
import sys
import threading
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from kvserve.errors import ModelLoadError
from kvserve.model.model_config import ModelConfig
from kvserve.model.quantization import QuantizedTensor, is_kernel_format

# per-layer GGUF tensor stem -> HF module path under model.layers.N
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# mixtures of experts: the router, the shared expert and its gate (Qwen2-MoE) are one tensor each; each of the
# experts' projections is one [E, rows, cols] tensor (_EXPERT_STACKS), split into the experts' own
_MOE_NAMES = {"ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
              "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
              "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
_EXPERT_STACKS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# where a family's tensors differ from the Llama names (llama.cpp's gemma3: ffn_norm is the MLP's pre-norm)
_GEMMA_NAMES = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_FAMILY_LAYER_NAMES = {"Gemma2ForCausalLM": _GEMMA_NAMES, "Gemma3ForCausalLM": _GEMMA_NAMES}
# llama.cpp stores Gemma's norm weights as 1 + w; transformers (and this loader) give back w
_NORMS_PLUS_ONE = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
# the large tokenizer arrays are only needed by the tokenizer conversion, not the model config
_SKIP_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")
_ROPE_FREQS = "rope_freqs.weight"


# the last files parsed, by (path, size, mtime): a process that starts several engines on one file (tests,
# benchmarks) parses its metadata once; the tokenizer's arrays are never parsed (_metadata_reader)
_READERS: OrderedDict = OrderedDict()
_READERS_KEPT = 2
_READERS_LOCK = threading.Lock()


def open_gguf(path: str):
    """A GGUFReader for `path` (shared: read it, do not change it), or ModelLoadError if the file is not a
    readable GGUF file."""
    try:
        key = _reader_key(path)
        with _READERS_LOCK:
            reader = _READERS.get(key)
            if reader is not None:
                _READERS.move_to_end(key)
                return reader
        reader = _metadata_reader()(path)
    except Exception as e:  # the reader raises ValueError, struct.error, IndexError... on corrupt files
        raise ModelLoadError(f"cannot read GGUF file {path}: {type(e).__name__}: {e}; "
                             "the file is corrupt, truncated or not GGUF") from e
    for name in _SKIP_KEYS:   # where gguf's own parsing read one (a reader without the skip, or not an array)
        reader.fields.pop(name, None)
    with _READERS_LOCK:
        _READERS[key] = reader
        while len(_READERS) > _READERS_KEPT:
            _READERS.popitem(last=False)
    return reader


@functools.cache
def _plain_view_reader():
    """gguf's GGUFReader parsing through a plain ndarray view of its np.memmap: a memmap runs two Python methods
    for every slice it hands out (__getitem__, __array_finalize__), which made most of the parse time of a
    49k-token vocabulary (benchmarks/LOG.md). The memmap itself is kept as `mapping`."""
    from gguf import GGUFReader

    class PlainViewReader(GGUFReader):
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value):
            self.mapping = value
            self._plain = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return PlainViewReader


@functools.cache
def _metadata_reader():
    """The plain-view reader that steps over the vocabulary's arrays (_SKIP_KEYS) without parsing them: gguf's
    reader builds a numpy view and a Python list entry for every token and merge (most of a file's parse time,
    benchmarks/LOG.md), and none of them is read here (the tokenizer is converted from the file apart,
    tokenizer.py). Every other field is parsed by gguf's own code. A gguf release without the private methods
    this overrides gets the plain reader (open_gguf drops those fields either way)."""
    import struct

    from gguf import GGUFValueType

    base = _plain_view_reader()
    if not (callable(getattr(base, "_build_fields", None)) and isinstance(getattr(base, "gguf_scalar_to_np", None),
                                                                          dict)):
        return base
    skipped = {key.encode() for key in _SKIP_KEYS}
    longest = max(map(len, skipped))

    class MetadataReader(base):
        def _build_fields(self, offs: int, count: int) -> int:
            for _ in range(int(count)):
                klen = int(self._get(offs, np.uint64)[0])   # a corrupt length is no reason to copy the file
                if klen <= longest and bytes(self.data[offs + 8:offs + 8 + klen]) in skipped:
                    end = self._array_end(offs + 8 + klen)
                    if end is not None:
                        offs = end
                        continue
                offs = super()._build_fields(offs, 1)
            return offs

        def _array_end(self, offs: int) -> int | None:
            """Where the value at `offs` (its type, then the value) ends, for an array of strings or scalars;
            None for anything else (parsed as gguf does)."""
            order = ">" if (self.byte_order == "S") == (sys.byteorder == "little") else "<"
            data = memoryview(self.data)
            vtype, itype, n = struct.unpack_from(order + "IIQ", data, offs)
            if vtype != GGUFValueType.ARRAY:
                return None
            offs += 16
            if itype == GGUFValueType.STRING:
                if offs + 8 * n > len(data):   # a corrupt count: no loop over it
                    raise ValueError(f"a metadata array of {n} strings runs past the end of the file")
                length = struct.Struct(order + "Q").unpack_from
                try:
                    for _ in range(n):
                        offs += 8 + length(data, offs)[0]
                except struct.error:
                    offs = len(data) + 1
            elif (dtype := self.gguf_scalar_to_np.get(GGUFValueType(itype))) is not None:
                offs += n * np.dtype(dtype).itemsize
            else:
                return None
            if offs > len(data):
                raise ValueError(f"a metadata array runs past the end of the file ({offs} > {len(data)})")
            return offs

    return MetadataReader


def release_file_pages(path: str) -> None:
    """Drop the file pages a load touched from this process's resident set, where open_gguf keeps a reader of
    `path` (they stay in the page cache, and fault back in if a later load reads them): the kept reader would
    otherwise count the whole file as resident memory."""
    try:
        reader = _READERS.get(_reader_key(path))
        if reader is not None and getattr(reader.mapping, "_mmap", None) is not None:
            reader.mapping._mmap.madvise(mmap.MADV_DONTNEED)
    except (AttributeError, OSError, ValueError):   # no file, or no madvise here
        pass


def _reader_key(path: str) -> tuple:
    """The file as it is now: a rename brings another inode, a rewrite another ctime (which utime cannot set)."""
    st = os.stat(path)
    return os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def gguf_metadata(reader) -> dict[str, Any]:
    """Key/value metadata as plain Python values (tokenizer vocab arrays left out)."""
    return {k: f.contents() for k, f in reader.fields.items() if k not in _SKIP_KEYS}


def gguf_model_config(reader) -> ModelConfig:
    """ModelConfig from a GGUF file's metadata and tensor list."""
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError("GGUF file has no token_embd.weight tensor")
    freqs = tensors.get(_ROPE_FREQS)
    factors = _dequantize(freqs).reshape(-1).tolist() if freqs is not None else None
    routed = sorted(int(m.group(1)) for name in tensors
                    if (m := _BLOCK_RE.match(name)) and m.group(2) == "ffn_gate_inp")   # the MoE layers' routers
    return ModelConfig.from_gguf_metadata(
        gguf_metadata(reader), vocab_rows=int(tensors["token_embd.weight"].shape[-1]),
        has_output="output.weight" in tensors, rope_freq_factors=factors, moe_layers=routed or None)


def hf_name(gguf_name: str, architecture: str = "LlamaForCausalLM") -> str:
    """Translate a GGUF tensor name (blk.3.attn_q.weight) to its HF name (model.layers.3.self_attn.q_proj.weight)."""
    m = _BLOCK_RE.match(gguf_name)
    names = {**_LAYER_NAMES, **_MOE_NAMES, **_FAMILY_LAYER_NAMES.get(architecture, {})}
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES and kind in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} is not known to kvserve's GGUF loader")


def iter_gguf_weights(reader, cfg: ModelConfig,
                      keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Yield (HF name, float32 tensor) for every GGUF tensor, dequantized and in HF layout; with keep_quantized,
    the matrices in a format the quantized kernels multiply come as QuantizedTensor (rows in HF order)."""
    is_llama = cfg.architecture in ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM")
    behind = _PagesBehind(reader)
    for t in reader.tensors:
        behind.release(int(t.data_offset))
        if t.name == _ROPE_FREQS:
            continue  # folded into cfg.rope_scaling
        m = _BLOCK_RE.match(t.name)
        if m and m.group(2) in _EXPERT_STACKS:
            yield from _expert_tensors(t, f"model.layers.{m.group(1)}.mlp.experts.{{}}.{_EXPERT_STACKS[m.group(2)]}."
                                          f"{m.group(3)}", keep_quantized)
            continue
        name = hf_name(t.name, cfg.architecture)
        heads = None
        if is_llama and (".q_proj." in name or ".k_proj." in name):
            heads = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
        if keep_quantized and len(t.shape) == 2 and is_kernel_format(int(t.tensor_type), int(t.shape[0])):
            yield name, _quantized(t, heads)
            continue
        weight = _dequantize(t)
        if heads is not None:
            weight = unpermute_qk(weight, heads)
        if cfg.architecture in _NORMS_PLUS_ONE and name.endswith("norm.weight"):
            weight = weight - np.float32(1.0)
        if name.endswith("shared_expert_gate.weight"):   # llama.cpp's [hidden], transformers' [1, hidden]
            weight = weight.reshape(1, -1)
        # F32 tensors come back as read-only views of the mapped file; torch wants writable memory
        yield name, torch.from_numpy(np.require(weight, requirements=["C", "W"]))


def _expert_tensors(t, name: str, keep_quantized: bool) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """An [experts, rows, cols] GGUF stack as each expert's [rows, cols] matrix, named name.format(expert): views
    of the file's blocks where kept quantized, else dequantized."""
    experts, rows, cols = int(t.shape[2]), int(t.shape[1]), int(t.shape[0])
    if keep_quantized and is_kernel_format(int(t.tensor_type), cols):
        data = t.data.view(np.ndarray)
        if data.dtype != np.uint8 or data.size % (experts * rows):
            raise ModelLoadError(f"GGUF tensor {t.name!r} holds {data.nbytes} bytes, not a whole number of its "
                                 f"{experts} x {rows} rows; the file is corrupt")
        data = data.reshape(experts, rows, -1)
        with warnings.catch_warnings():   # the mapping is read-only, and only ever read
            warnings.simplefilter("ignore", UserWarning)
            for e in range(experts):
                yield name.format(e), QuantizedTensor(int(t.tensor_type), torch.from_numpy(data[e]), cols)
        return
    weight = _dequantize(t)
    for e in range(experts):
        yield name.format(e), torch.from_numpy(np.require(weight[e], requirements=["C", "W"]))


class _PagesBehind:
    """Drops the mapped file's pages well behind the tensor being read from this process's resident set as a load
    goes (release_file_pages drops the rest at its end): the model's copies of the weights and the file's pages
    then never both count in full, and a load peaks near the loaded model's size instead of about twice it. A
    page a consumer still holds (a fused projection's earlier shards wait for its last) just faults back in from
    the page cache when read."""

    LAG = 64 << 20      # the most bytes kept mapped behind the tensor being read
    MIN_LAG = 4 << 20

    def __init__(self, reader):
        self.mmap = getattr(getattr(reader, "mapping", None), "_mmap", None)
        self.done = 0
        # two layers' tensors: a layer's fused shards (q, k, v; gate, up) are read before its module is built
        layers = collections.Counter()
        for t in reader.tensors:
            m = _BLOCK_RE.match(t.name)
            if m:
                layers[m.group(1)] += int(t.n_bytes)
        self.lag = min(self.LAG, max(self.MIN_LAG, 2 * max(layers.values(), default=0)))

    def release(self, offset: int) -> None:
        end = (offset - self.lag) // mmap.PAGESIZE * mmap.PAGESIZE
        if self.mmap is None or end <= self.done:
            return
        try:
            self.mmap.madvise(mmap.MADV_DONTNEED, self.done, end - self.done)
            self.done = end
        except (AttributeError, OSError, ValueError):   # no madvise here, or a closed mapping
            self.mmap = None


def _quantized(t, heads: int | None) -> QuantizedTensor:
    """A GGUF matrix's blocks as a view of the mapped file (QuantizedWeight copies them into its own buffer once),
    rows unpermuted where `heads` is given (a copy, of the q/k rows only)."""
    rows, cols = int(t.shape[1]), int(t.shape[0])
    data = t.data.view(np.ndarray)
    if data.dtype != np.uint8 or data.size % rows:
        raise ModelLoadError(f"GGUF tensor {t.name!r} holds {data.nbytes} bytes, not a whole number of its {rows} "
                             "rows; the file is corrupt")
    with warnings.catch_warnings():   # the mapping is read-only, and only ever read
        warnings.simplefilter("ignore", UserWarning)
        qt = QuantizedTensor(int(t.tensor_type), torch.from_numpy(data.reshape(rows, -1)), cols)
    if heads is not None:
        qt = qt.select_rows(unpermute_qk(np.arange(rows), heads))
    return qt


def _dequantize(t) -> np.ndarray:
    from gguf import dequantize
    try:
        # a plain ndarray view: gguf slices row by row, and numpy.memmap slicing is ~10x slower
        out = dequantize(t.data.view(np.ndarray), t.tensor_type)
    except NotImplementedError:
        raise ModelLoadError(f"GGUF tensor {t.name!r} uses quantization type {t.tensor_type.name}, "
                             "which gguf-py cannot dequantize") from None
    # gguf stores dims innermost-first; numpy wants them outermost-first
    shape = tuple(int(d) for d in reversed(t.shape))
    try:
        return out.reshape(shape)
    except ValueError:
        raise ModelLoadError(f"GGUF tensor {t.name!r} holds {out.size} values, expected shape {shape}; "
                             "the file is corrupt") from None


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs) back to HF's rotate_half layout."""
    # convert_hf_to_gguf reshapes rows as (heads, 2, D/2) and swaps to (heads, D/2, 2); this is the inverse
    half = weight.shape[0] // num_heads // 2
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)
