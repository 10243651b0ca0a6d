"""The AVX2 build's packed bf16 matmul (bf16 weights widened to float32 in registers) against oneDNN's float32
matmul on the same shapes, side by side: what an AVX2 machine ran for dense models before (float32, oneDNN) and
runs now (bf16). On an AVX-512 machine, run it as an AVX2 one:

    ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/bf16_matmul_avx2.py

and as an AVX-512 CPU without BF16 (Skylake to Ice Lake; the GEMM's tiles then take 16 lanes):

    ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI python benchmarks/bf16_matmul_avx2.py no-avx512bf16

The fp16 column is the same matmul on the weights in fp16 (an fp16 checkpoint's, widened by F16C).
"""
import torch, sys, time
from kvserve import kernels
torch.set_num_threads(2)
lib = kernels.load_variant(sys.argv[1] if len(sys.argv) > 1 else "no-avx512")
assert lib.kvserve_packed_matmul_kind() == 2, "not a build that widens bf16 weights"
def best(f, n=20):
    f(); t = []
    for _ in range(n):
        t0 = time.perf_counter(); f(); t.append(time.perf_counter() - t0)
    return min(t)
g = torch.Generator().manual_seed(0)
shapes = {"smol qkv": (960, 576), "smol gate_up": (3072, 576), "smol down": (576, 1536), "qwen1.5B gate_up": (17920, 1536), "qwen1.5B down": (1536, 8960)}
f16 = bool(lib.kvserve_has_packed_matmul_f16())
print(f"{'shape':18} {'M':>4} {'widened ms':>12} {'oneDNN f32 ms':>13} {'ratio':>6} {'fp16 ms':>9}")
for name, (n, k) in shapes.items():
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    wp = torch.empty(kernels.packed_numel(n, k), dtype=torch.bfloat16)
    kernels.pack_weight(lib, w, wp)
    wf = torch.ops.mkldnn._reorder_linear_weight(w.float(), 1)
    wp16 = torch.empty(kernels.packed_numel(n, k), dtype=torch.float16)
    if f16:
        kernels.pack_weight(lib, w.to(torch.float16), wp16)
    for m in [1, 4, 8, 32, 256]:
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        xf = x.float()
        y = torch.empty(m, n, dtype=torch.bfloat16)
        ta = best(lambda: lib.kvserve_packed_matmul_bf16(x.data_ptr(), k, wp.data_ptr(), y.data_ptr(), n, m, n, k))
        tb = best(lambda: torch.ops.mkldnn._linear_pointwise(xf, wf, None, "none", [], ""))
        tc = best(lambda: lib.kvserve_packed_matmul_f16(x.data_ptr(), k, wp16.data_ptr(), y.data_ptr(), n, m, n, k)) \
            if f16 else float("nan")
        print(f"{name:18} {m:4d} {ta*1e3:12.3f} {tb*1e3:13.3f} {tb/ta:6.2f}x {tc*1e3:9.3f}")
