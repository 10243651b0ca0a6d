"""How a linear multiplies: one method object per linear, the one home of its weight once loaded.

Every Linear, the output head and the token embedding hold a LinearMethod (`.method`):
- DENSE: the module's own `weight` parameter, multiplied by F.linear (looked up by F.embedding);
- PackedBf16Method: a bf16 CPU weight packed once for kvserve/csrc/gemv.cpp's kernels (16 output columns x 2
  inputs per 64-byte line; a GEMV for a few rows, register-tiled GEMM beyond), where they build: AVX-512 BF16,
  or AVX2 and AVX-512 without BF16 (the pairs widened to float32 in registers); PackedF16Method the same for an
  fp16 checkpoint's weight on the widening builds (F16C: widened exactly, the activations bf16);
- OneDNNMethod: a weight in oneDNN's blocked layout (float32 everywhere; bf16 where the C++ kernels are missing);
- QuantizedMethod: blocks kept quantized, a GGUF's formats or int8 W8A8 (kvserve/model/quantization.py).
A packed or quantized method leaves the module's `weight` shape-only where it can give the plain weight back
(release_plain_weight). `apply(layer, x, bias)` is what Linear.forward and the head call; `kernel_weight()` is what
the fused C++ stack (kvserve/model/fused.py) multiplies by; `rows(layer, ids)` what an embedding looks up.
"""
from __future__ import annotations

import collections
import functools

import torch
import torch.nn.functional as F
from torch import nn

from kvserve import kernels, memory
from kvserve.model.quantization import QuantizedWeight, embedding_rows, quantized_matmul


class LinearMethod:
    """x @ W^T for a weight [N, K]; subclasses hold the weight in their layout."""

    kind = "dense"
    quant: QuantizedWeight | None = None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if layer.weight.is_meta:   # F.linear would return a meta tensor, and the kernels would read address 0
            raise RuntimeError("this layer's plain weight was released after packing and its method reset; "
                               "restore_unpacked_weights(model) brings the weights back")
        return F.linear(x, layer.weight, bias)

    def rows(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows `ids` of this weight (a token embedding's lookup)."""
        return F.embedding(ids, layer.weight)

    def kernel_weight(self) -> tuple[int, int] | None:
        """(pointer, 1 if a kvserve_quant_matmul descriptor else 0) the fused C++ stack multiplies by, or None where
        it has no kernel for this method."""
        return None

    def can_unpack(self) -> bool:
        """Whether unpack gives the plain weight back (then the module's own copy may be released)."""
        return False

    def unpack(self, in_features: int) -> torch.Tensor:
        """The plain weight [N, K] back, exactly (where can_unpack)."""
        raise NotImplementedError(f"a {self.kind} weight is not unpacked")


DENSE = LinearMethod()

_generation = 0   # bumped whenever a module's method is replaced


def method_generation() -> int:
    """A counter that changes whenever any module's method is replaced (the fused stack's pointers go stale)."""
    return _generation


def invalidate_bindings() -> None:
    """Count a change that C++ descriptors built over the methods must follow (method_generation)."""
    global _generation
    _generation += 1


def _set_method(module: nn.Module, method: LinearMethod) -> None:
    invalidate_bindings()
    module._method = method


# a module's `method` attribute: reads are plain, replacements counted (method_generation)
method_attribute = property(lambda self: self._method, _set_method,
                            doc="The LinearMethod this module multiplies (or looks up) by.")


class PackedBf16Method(LinearMethod):
    """A bf16 weight in the C++ kernels' layout (a view of one huge-page buffer shared by the model's packs)."""

    kind = "packed bf16"
    kernel_kind = 0   # the fused stack's LinearDesc.quantized for it (kvserve/csrc/layers.cpp)

    def __init__(self, out_features: int, kernel: torch.Tensor, lib):
        self.out_features, self.kernel, self.kernel_ptr, self.lib = out_features, kernel, kernel.data_ptr(), lib
        self.matmul = lib.kvserve_packed_matmul_bf16

    def apply(self, layer, x, bias=None):
        if x.dim() != 2 or x.stride(1) != 1:
            return self.apply(layer, x.reshape(-1, x.shape[-1]).contiguous(), bias).view(*x.shape[:-1], -1)
        n = self.out_features   # the call inlined: decode steps make 121 of these per token
        y = x.new_empty(x.shape[0], n)
        self.matmul(x.data_ptr(), x.stride(0), self.kernel_ptr, y.data_ptr(), n, x.shape[0], n, x.shape[1])
        return y if bias is None else y + bias

    def kernel_weight(self):
        return self.kernel_ptr, self.kernel_kind

    def _pairs(self, k: int) -> torch.Tensor:
        """The pack as [column block, input pair, column in the block, pair element] (gemv.cpp's layout)."""
        return self.kernel.view(-1, k // 2, 16, 2)

    def rows(self, layer, ids):
        """Rows of W straight from the pack (exact): a tied model's embedding needs no copy of its own."""
        k = layer.weight.shape[1]
        return self._pairs(k)[ids // 16, :, ids % 16, :].reshape(ids.shape[0], k)

    def can_unpack(self):
        return True

    def unpack(self, in_features):
        """The pack is a permutation: exact."""
        k = in_features
        return self._pairs(k).permute(0, 2, 1, 3).reshape(-1, k)[:self.out_features].clone()


class PackedF16Method(PackedBf16Method):
    """An fp16 weight (an fp16 checkpoint's, kept exact) in the same layout, for bf16 activations: each weight
    widened to float32 by F16C (kvserve_packed_matmul_f16, the widening builds only)."""

    kind = "packed fp16"
    kernel_kind = 2

    def __init__(self, out_features: int, kernel: torch.Tensor, lib):
        super().__init__(out_features, kernel, lib)
        self.matmul = lib.kvserve_packed_matmul_f16

    def _pairs(self, k: int) -> torch.Tensor:
        """As PackedBf16Method's (a copy): each 16 columns' pair of inputs is stored as two halves of 8 columns,
        each the columns' first inputs then their second (kvserve_gemv_pack_f16)."""
        return self.kernel.view(-1, k // 2, 2, 2, 8).transpose(3, 4).reshape(-1, k // 2, 16, 2)

    def rows(self, layer, ids):
        """Rows of W from the pack, in the activations' dtype (as the table's lookups give)."""
        k = layer.weight.shape[1]
        col = ids % 16
        rows = self.kernel.view(-1, k // 2, 2, 2, 8)[ids // 16, :, col // 8, :, col % 8]   # [ids, pairs, 2]
        return rows.reshape(ids.shape[0], k).to(torch.bfloat16)


class OneDNNMethod(LinearMethod):
    """A weight in oneDNN's blocked layout: bit-identical to F.linear in bf16; in float32 it sums in another order
    than F.linear (MKL) and agrees to rounding, and reads a few rows' weights once (MKL's F.linear costs several
    single-row passes for 2-8 rows)."""

    kind = "oneDNN"

    def __init__(self, out_features: int, onednn: torch.Tensor):
        self.out_features, self.onednn = out_features, onednn

    def apply(self, layer, x, bias=None):
        y = torch.ops.mkldnn._linear_pointwise(x, self.onednn, None, "none", [], "")
        return y if bias is None else y + bias

    def can_unpack(self):
        return self.onednn.dtype == torch.float32

    def unpack(self, in_features):
        """float32 only, as I_K @ W^T (each entry one product by 1 plus zeros: exact for finite weights, -0.0
        coming back as 0.0; an infinite or NaN weight makes its row NaN)."""
        return self.apply(None, torch.eye(in_features, dtype=torch.float32)).t().contiguous()


class QuantizedMethod(LinearMethod):
    """Blocks kept quantized (GGUF formats, int8 W8A8), for any activation dtype (kvserve_quant_matmul)."""

    kind = "quantized"

    def __init__(self, quant: QuantizedWeight):
        self.quant, self.out_features = quant, quant.out_features

    def apply(self, layer, x, bias=None):
        y = quantized_matmul(x, self.quant)
        return y if bias is None else y + bias

    def rows(self, layer, ids):
        return embedding_rows(self.quant.segments[0], ids, layer.weight.dtype)   # a table is one segment

    def kernel_weight(self):
        return self.quant.desc_ptr, 1


def keep_quantized(module: nn.Module, quant: QuantizedWeight) -> None:
    """Make `module` (a Linear or an embedding) multiply `quant`; its plain weight becomes shape-only."""
    module.method = QuantizedMethod(quant)
    shape_only(module)


def shape_only(module: nn.Module) -> None:
    """Replace a module's weight by a meta tensor of its shape and dtype (its storage freed)."""
    w = module.weight
    module.weight = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=False)


def _kernel_lib():
    lib = kernels.load()
    return lib if lib is not None and lib.kvserve_has_packed_matmul() else None


def packs_fp16() -> bool:
    """Whether fp16 weights pack for the C++ kernels here (the widening builds with F16C)."""
    lib = _kernel_lib()
    return lib is not None and bool(lib.kvserve_has_packed_matmul_f16())


def can_prepack(weight: torch.Tensor) -> bool:
    """True where a packed weight is available: CPU and bf16, with the C++ matmul kernels or a torch built with
    mkldnn; CPU and float32 with mkldnn; CPU and fp16 with the widening kernels (packs_fp16)."""
    if weight.device.type == "cpu" and weight.dtype == torch.float32:
        return onednn_available(torch.float32)
    if weight.device.type == "cpu" and weight.dtype == torch.float16:
        return packs_fp16() and weight.shape[1] % 2 == 0
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return False
    if _kernel_lib() is not None and weight.shape[1] % 2 == 0:
        return True
    return onednn_available(torch.bfloat16)


@functools.cache
def onednn_available(dtype: torch.dtype) -> bool:
    """Whether this torch and CPU pack linears of `dtype` for oneDNN (bf16 needs AVX-512 or AVX-NE-CONVERT)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ones(8, 8, dtype=dtype)
        OneDNNMethod(8, _onednn_pack(w)).apply(None, torch.ones(1, 8, dtype=dtype))
        return True
    except (RuntimeError, AttributeError):
        return False


def _onednn_pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1)


def prepack_weights(weights: list[torch.Tensor], onednn: bool = False,
                    on_packed=None, consume: bool = False) -> list[LinearMethod]:
    """Pack weights [N, K] once (they must not change afterwards): the C++ kernels' layout where they build and
    every weight is bf16 with an even K, else oneDNN's. The C++ kernels' copies share one huge-page buffer: decode
    steps read it from start to end. onednn=True packs for oneDNN even where the kernels exist (benchmarks compare
    the two). on_packed(i, method) is called as soon as weights[i] is packed (prepack_linears drops the plain
    weight there, and its entry in `weights`). consume: the caller drops every plain weight once it is packed, so
    the C++ packs hand each one's pages back to the OS as they go (kernels.pack_weight)."""
    lib = _kernel_lib()
    fp16 = torch.float16 if packs_fp16() else None   # fp16 weights (an fp16 checkpoint's) where they pack
    onednn = onednn or lib is None or any(w.shape[1] % 2 or w.dtype not in (torch.bfloat16, fp16) for w in weights)
    if not onednn:
        sizes = [kernels.packed_numel(*w.shape) for w in weights]
        parts = [part.view(w.dtype) for part, w in
                 zip(memory.huge_page_buffer(2 * sum(sizes)).view(torch.bfloat16).split(sizes), weights)]
    packs: list[LinearMethod] = []
    seen = collections.Counter(id(w) for w in weights)   # a weight two modules share is packed whole, not consumed
    for i in range(len(weights)):
        w = weights[i]
        if onednn:
            packs.append(OneDNNMethod(w.shape[0], _onednn_pack(w)))
        else:
            kernels.pack_weight(lib, w, parts[i], consume=consume and seen[id(w)] == 1)
            packs.append((PackedF16Method if w.dtype == torch.float16 else PackedBf16Method)(w.shape[0], parts[i],
                                                                                               lib))
        del w
        if on_packed is not None:
            on_packed(i, packs[-1])
    return packs
