"""The CPU kernels beside attention: float32 and bf16 linears (oneDNN-packed, the C++ matmuls) against F.linear,
and the fused bf16 RMSNorm, RoPE and SiLU-and-mul kernels against the torch ops they replace."""
import pytest
import torch

from kvserve import kernels

needs_kernels = pytest.mark.skipif(kernels.load() is None, reason="no C++ compiler")


@pytest.mark.parametrize("bias", [False, True])
def test_onednn_packed_linear_equals_f_linear_in_bfloat16(bias):
    """oneDNN's packed path (where the C++ matmul kernels do not build) agrees with F.linear to bf16 rounding."""
    from kvserve.model.layers import Linear
    from kvserve.model.linear_method import OneDNNMethod, onednn_available, prepack_weights
    lin = Linear(64, 96, bias=bias).to(torch.bfloat16)
    for p in lin.parameters():
        torch.nn.init.normal_(p)
    if not onednn_available(torch.bfloat16):
        pytest.skip("oneDNN has no bf16 linear on this CPU (it needs AVX-512 or AVX-NE-CONVERT)")
    pack, = prepack_weights([lin.weight], onednn=True)
    assert isinstance(pack, OneDNNMethod)
    for rows in (7, 300):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        plain = lin(x)
        packed = pack.apply(lin, x, lin.bias)
        # close, not bit-equal: the pack's blocked layout and F.linear's plain weight take different oneDNN (or
        # ATen) paths whose float32 summation orders differ by CPU, and a bf16 rounding can then differ; without a
        # bias, nearly every value is the same bits (a bias is added after rounding the product to bf16)
        torch.testing.assert_close(packed, plain, atol=0.5, rtol=2e-2)
        if not bias:
            assert (packed != plain).float().mean() < 0.01


@pytest.mark.parametrize("bias", [False, True])
def test_onednn_packed_linear_agrees_with_f_linear_in_float32_and_unpacks_exactly(bias):
    """float32 Linears are packed for oneDNN on the CPU: the product agrees with F.linear to rounding at every
    row count (1-8 rows are why: MKL's F.linear reads the weight once per row there), strided and 3-d inputs
    included, and the plain weight comes back exactly from the pack."""
    from kvserve.model.layers import Linear, prepack_linears
    from kvserve.model.linear_method import OneDNNMethod, can_prepack, onednn_available
    if not onednn_available(torch.float32):
        pytest.skip("this torch has no oneDNN")
    g = torch.Generator().manual_seed(int(bias))
    lin = Linear(96, 200, bias=bias)
    for p in lin.parameters():
        p.copy_(torch.randn(p.shape, generator=g))
    lin.weight[0, 0] = -0.0
    assert can_prepack(lin.weight) and prepack_linears(lin)[0] == 1
    assert isinstance(lin.method, OneDNNMethod) and lin.method.can_unpack()
    for rows in (1, 2, 3, 6, 8, 9, 37, 300):
        x = torch.randn(rows, 100, generator=g)[:, :96]
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias), atol=1e-4, rtol=1e-5)
    x3 = torch.randn(2, 5, 96, generator=g)
    torch.testing.assert_close(lin(x3), torch.nn.functional.linear(x3, lin.weight, lin.bias), atol=1e-4, rtol=1e-5)
    assert torch.equal(lin.method.unpack(96), lin.weight)


def test_float32_serving_keeps_one_copy_of_the_weights():
    """The engine drops each float32 Linear's plain weight once it is packed for oneDNN; restoring gives back
    exactly the loaded weights."""
    from kvserve import LLM
    from kvserve.model.layers import Linear, restore_unpacked_weights
    from kvserve.model.linear_method import OneDNNMethod, onednn_available
    from model_utils import load_ours
    if not onednn_available(torch.float32):
        pytest.skip("this torch has no oneDNN")
    llm = LLM(dtype="float32", max_model_len=256, enable_prefix_caching=False, quantization="none")
    model = llm.llm_engine.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight.is_meta and isinstance(m.method, OneDNNMethod) for m in linears)
    assert llm.llm_engine.runner.released_weight_bytes == sum(4 * m.weight.numel() for m in linears)
    restore_unpacked_weights(model)
    fresh, _ = load_ours(None, "float32")
    for (name, got), (_, want) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(got, want), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepack_with_release_drops_each_plain_weight_as_its_pack_is_made(dtype, monkeypatch):
    """The engine's packing never holds all plain weights and all packs at once: when weight i is packed, the
    plain weights before it are freed already (no reference left); the packs multiply as those made with the
    plain weights kept do. A pack that cannot give its weight back (bf16 for oneDNN) keeps it."""
    import weakref
    from kvserve.model import layers, linear_method
    if not linear_method.can_prepack(torch.empty(4, 8, dtype=dtype)):
        pytest.skip(f"no packed path for {dtype} here")

    def model() -> torch.nn.Module:
        m = torch.nn.Sequential(*[layers.Linear(64, 32) for _ in range(5)]).to(dtype)
        for i, lin in enumerate(m):
            lin.weight.copy_(torch.randn(32, 64, generator=torch.Generator().manual_seed(i)))
        return m
    kept, released = model(), model()
    assert layers.prepack_linears(kept)[0] == 5 and not any(lin.weight.is_meta for lin in kept)
    releasable = kept[0].method.can_unpack()
    plain = [weakref.ref(lin.weight) for lin in released]
    alive_at_each_pack = []
    spied = (kernels, "pack_weight") if kept[0].method.kind == "packed bf16" else (linear_method, "_onednn_pack")
    pack = getattr(*spied)

    def spy(*args, **kwargs):
        alive_at_each_pack.append(sum(ref() is not None for ref in plain))
        return pack(*args, **kwargs)
    monkeypatch.setattr(*spied, spy)
    assert layers.prepack_linears(released, release=True)[0] == 5
    assert alive_at_each_pack == ([5, 4, 3, 2, 1] if releasable else [5] * 5)
    assert all(lin.weight.is_meta == releasable for lin in released)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(9)).to(dtype)
    for a, b in zip(kept, released):
        assert torch.equal(a(x), b(x))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_consuming_pack_is_the_same_pack_and_hands_the_plain_weight_back(dtype, monkeypatch):
    """pack_weight(consume=True) (prepack's release: the plain weight is dropped next) packs a few panels at a time
    and hands each part's pages back to the OS as it goes, so the weight and its pack never both take memory: the
    pack is the same bits as a whole one (the parts end on panel bounds, the last panel padded), the weight's whole
    pages read as zeros after; a weight whose storage another tensor shares is left as it was."""
    from kvserve import memory
    from kvserve.model.linear_method import packs_fp16
    lib = kernels.load()
    if not lib.kvserve_has_packed_matmul() or (dtype == torch.float16 and not packs_fp16()):
        pytest.skip(f"no packed {dtype} matmul here")
    monkeypatch.setattr(kernels, "_CONSUME_BYTES", 40 * 576 * 2)   # 32 rows a part: 38 parts, the last one short
    n, k = 1203, 576
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(3)).to(dtype)
    whole, parts = (torch.empty(kernels.packed_numel(n, k), dtype=dtype) for _ in range(2))
    kernels.pack_weight(lib, weight, whole)
    consumed = weight.clone()
    kernels.pack_weight(lib, consumed, parts, consume=True)
    assert torch.equal(parts.view(torch.int16), whole.view(torch.int16))
    start, page = consumed.data_ptr(), memory.PAGE
    lo, hi = -(-start // page) * page - start, (start + consumed.nbytes) // page * page - start   # its whole pages
    values = consumed.view(torch.int16).flatten()
    assert not values[lo // 2:hi // 2].any() and lo < page and consumed.nbytes - hi < page
    shared = weight.clone()
    view = shared[1:]
    kernels.pack_weight(lib, shared, parts, consume=True)
    assert torch.equal(shared, weight) and torch.equal(parts.view(torch.int16), whole.view(torch.int16))
    del view


@needs_kernels
def test_a_weight_two_modules_share_is_packed_whole_and_a_torch_without_the_use_count_consumes_nothing(monkeypatch):
    """Two Linears holding one Parameter: consuming it for the first pack would leave zeros for the second, so it is
    packed whole; where torch lacks the storage use count, discard_pages hands nothing back."""
    from kvserve import memory
    from kvserve.model.layers import Linear, prepack_linears
    if not kernels.load().kvserve_has_packed_matmul():
        pytest.skip("no packed bf16 matmul here")
    g = torch.Generator().manual_seed(5)
    first, second = Linear(576, 4096).to(torch.bfloat16), Linear(576, 4096).to(torch.bfloat16)
    first.weight.copy_(torch.randn(4096, 576, generator=g))
    second.weight = first.weight
    model = torch.nn.Sequential(first, second)
    x = torch.randn(3, 576, generator=g).to(torch.bfloat16)
    want = torch.nn.functional.linear(x, first.weight)
    assert prepack_linears(model, release=True)[0] == 2
    assert torch.equal(first(x), second(x))
    torch.testing.assert_close(first(x).float(), want.float(), atol=0.5, rtol=2e-2)   # bf16 rounding apart
    monkeypatch.delattr(torch._C, "_storage_Use_Count")
    w = torch.ones(1 << 20)
    assert memory.discard_pages(w, 0, w.nbytes) == 0 and bool((w == 1).all())


@needs_kernels
def test_the_engines_prepack_hands_every_plain_weight_back_as_it_packs(tmp_path, monkeypatch):
    """A tied bf16 model's prepack (the engine's, release=True) consumes every weight it packs, the embedding table
    (the head's pack) included: the pages handed back come to the plain weights' bytes, less at most two partial
    pages each. A module holding a second view of its weight would keep it whole, and the load would peak with
    both copies; the model still computes what a kept-weights copy computes."""
    from kvserve import memory
    from kvserve.model.layers import Linear
    from kvserve.model.linear_method import PackedBf16Method
    from model_utils import load_ours, save_tiny_model
    if not kernels.load().kvserve_has_packed_matmul():
        pytest.skip("no packed bf16 matmul here")
    monkeypatch.setattr(kernels, "_CONSUME_BYTES", 64 << 10)   # the table in 8 parts
    save_tiny_model("llama", tmp_path, vocab_size=4096, tie_word_embeddings=True)
    released, _ = load_ours(str(tmp_path), "bfloat16")
    kept, _ = load_ours(str(tmp_path), "bfloat16")
    weights = [m.weight for m in released.modules() if isinstance(m, Linear)] + [released.model.embed_tokens.weight]
    nbytes, count = sum(w.nbytes for w in weights), len(weights)
    handed_back = []
    discard = memory.discard_pages
    monkeypatch.setattr(memory, "discard_pages", lambda *a: handed_back.append(discard(*a)) or handed_back[-1])
    del weights
    released.prepack(release=True)
    kept.prepack()
    assert isinstance(released.tied_head, PackedBf16Method) and released.model.embed_tokens.weight.is_meta
    assert nbytes - 2 * memory.PAGE * count <= sum(handed_back) <= nbytes
    ids = torch.tensor([5, 900, 4095, 17])
    assert torch.equal(released.model.embed_tokens(ids), kept.model.embed_tokens(ids))
    hidden = torch.randn(4, released.model.embed_tokens.weight.shape[1]).to(torch.bfloat16)
    assert torch.equal(released.tied_head.apply(released.model.embed_tokens, hidden),
                       kept.tied_head.apply(kept.model.embed_tokens, hidden))


@needs_kernels
@pytest.mark.parametrize("out_features", [100, 48])
def test_matmul_kernels_are_as_close_to_float32_as_f_linear(out_features):
    """The C++ matmuls (GEMV up to 8 rows, register tiles of 6 rows x 64 columns beyond, a remainder of 1-2 rows
    sharing the last two tiles; strided rows; 3-d input; N not a multiple of 16 or 64) round like F.linear: their
    error against the float32 product is within bf16 rounding, as F.linear's is."""
    from kvserve.model.layers import Linear, prepack_linears
    from kvserve.model.linear_method import PackedBf16Method, can_prepack
    g = torch.Generator().manual_seed(out_features)
    lin = Linear(576, out_features).to(torch.bfloat16)
    lin.weight.copy_(torch.randn(out_features, 576, generator=g))
    if not kernels.load().kvserve_has_packed_matmul():
        pytest.skip("no AVX2: no C++ matmul kernels")
    assert can_prepack(lin.weight) and prepack_linears(lin)[0] == 1
    assert isinstance(lin.method, PackedBf16Method)   # one packed copy, not two
    for rows in [*range(1, 15), 20, 32, 37, 100, 257, 1030]:   # 13, 14, 20, 32: last tiles 4 + 3 or 4 + 4
        wide = torch.randn(rows, 600, generator=g).to(torch.bfloat16)
        x = wide[:, :576]   # rows with a stride of 600
        exact = x.float() @ lin.weight.float().t()
        got, plain = lin(x), torch.nn.functional.linear(x, lin.weight)
        assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
        err_got, err_plain = ((t.float() - exact).abs().max().item() for t in (got, plain))
        assert err_got <= 1.5 * err_plain + 1e-2
        torch.testing.assert_close(got.float(), exact, rtol=2 ** -7, atol=0.05)
    x3 = torch.randn(2, 5, 576, generator=g).to(torch.bfloat16)
    torch.testing.assert_close(lin(x3).float(), x3.float() @ lin.weight.float().t(), rtol=2 ** -7, atol=0.05)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_fused_bf16_layer_ops_equal_the_torch_ops(rows, monkeypatch):
    """RMSNorm (+ residual add), RoPE and SiLU-and-mul kernels round like the chain of torch ops they replace."""
    from kvserve.model import layers, rotary
    g = torch.Generator().manual_seed(rows)
    bf = torch.bfloat16
    norm = layers.RMSNorm(576, 1e-5).to(bf)
    norm.weight.copy_(torch.rand(576, generator=g) + 0.5)
    x, res = (torch.randn(rows, 576, generator=g).to(bf) for _ in range(2))
    qkv = torch.randn(rows, 15 * 64, generator=g).to(bf)
    rope = rotary.RotaryEmbedding(64, 2048, 10000.0)
    cos, sin = rope(torch.randint(0, 2048, (rows,), generator=g), bf)
    fast = (norm(x), *norm(x, res.clone()))
    fast_qkv = qkv.clone()
    assert layers.rotate_heads_inplace(fast_qkv, 12, 64, cos, sin)
    gate_up = (torch.randn(rows, 2 * 1536, generator=g) * 4).to(bf)
    gate_up[0, :6] = torch.tensor([100.0, -100.0, 0.0, -0.0, 1e-30, -95.0])   # exp overflow and underflow
    fast_act = layers.SiluAndMul()(gate_up)
    monkeypatch.setattr(layers, "_fast_lib", lambda x: None)
    slow = (norm(x), *norm(x, res.clone()))
    assert torch.equal(fast_act, layers.SiluAndMul()(gate_up))
    slow_qkv = qkv.clone().view(rows, 15, 64)
    slow_qkv[:, :12] = layers.apply_rotary(slow_qkv[:, :12], cos, sin)
    for a, b in zip(fast, slow):
        assert (a.float() - b.float()).abs().max().item() <= 0.0625 * b.float().abs().max().item() / 64
        assert (a != b).float().mean().item() < 0.01   # rare 1-ulp differences (exp, summation order)
    assert torch.equal(fast_qkv, slow_qkv.view(rows, -1))


@needs_kernels
@pytest.mark.parametrize("rows", [1, 300])
def test_gelu_tanh_and_head_norm_kernels_equal_the_torch_ops(rows, monkeypatch):
    """GELU-tanh-and-mul (Gemma's GeGLU) and the in-place per-head q/k norm (Qwen3, Gemma 3) against torch's ops."""
    from kvserve.model import layers
    g = torch.Generator().manual_seed(rows)
    bf = torch.bfloat16
    gate_up = (torch.randn(rows, 2 * 1000, generator=g) * 4).to(bf)   # 1000: a scalar tail after the vectors
    gate_up[0, :6] = torch.tensor([100.0, -100.0, 0.0, -0.0, 1e-30, -95.0])   # exp overflow and underflow
    q_norm, k_norm = layers.RMSNorm(64, 1e-6).to(bf), layers.RMSNorm(64, 1e-6).to(bf)
    q_norm.weight.copy_(torch.rand(64, generator=g) + 0.5)
    k_norm.weight.copy_(torch.rand(64, generator=g) + 0.5)
    qkv = torch.randn(rows, 12 * 64, generator=g).to(bf)
    fast_act = layers.GeluTanhAndMul()(gate_up)
    fast_qkv = qkv.clone()
    assert layers.qk_norm_inplace(fast_qkv, q_norm, k_norm, 8, 2, 64)
    monkeypatch.setattr(layers, "_fast_lib", lambda x: None)
    slow_act = layers.GeluTanhAndMul()(gate_up)
    assert not layers.qk_norm_inplace(qkv.clone(), q_norm, k_norm, 8, 2, 64)
    heads = qkv.view(rows, 12, 64)
    slow_qkv = torch.cat([q_norm(heads[:, :8].reshape(-1, 64)).view(rows, -1),
                          k_norm(heads[:, 8:10].reshape(-1, 64)).view(rows, -1), qkv[:, 640:]], dim=1)
    for a, b in ((fast_act, slow_act), (fast_qkv, slow_qkv)):
        assert (a.float() - b.float()).abs().max().item() <= b.float().abs().max().item() / 64
        assert (a != b).float().mean().item() < 0.01   # rare 1-ulp differences (exp, tanh, summation order)
    assert torch.equal(fast_qkv[:, 640:], qkv[:, 640:])   # v untouched


@needs_kernels
def test_activation_kernels_agree_bit_for_bit_between_the_avx512_and_avx2_builds():
    """SiLU- and GELU-tanh-and-mul compute the same float32 values on 16 lanes and on 8: the AVX2 build (what an
    AVX2 machine runs) gives the AVX-512 build's bits (on rows a multiple of 16 long: a shorter tail runs the scalar
    exp in one build and the 8-lane one in the other)."""
    from kvserve.kernels import load_variant
    native, avx2 = load_variant("native"), load_variant("no-avx512")
    if native is None or avx2 is None or native.kvserve_packed_matmul_kind() != 1:
        pytest.skip("needs a CPU with AVX-512 BF16 to compare the two builds")
    x = (torch.randn(37, 2 * 1024, generator=torch.Generator().manual_seed(0)) * 4).to(torch.bfloat16)
    for name in ("kvserve_silu_mul_bf16", "kvserve_gelu_tanh_mul_bf16"):
        outs = []
        for lib in (native, avx2):
            out = x.new_empty(37, 1024)
            getattr(lib, name)(x.data_ptr(), x.stride(0), out.data_ptr(), 37, 1024)
            outs.append(out)
        assert torch.equal(*outs), name


@needs_kernels
@pytest.mark.parametrize("n,k", [(100, 48), (960, 576), (576, 1536), (33, 64), (40, 50)])   # 50: x's tail
def test_widening_packed_matmul_is_as_close_to_float32_as_a_rounding(n, k):
    """The packed bf16 matmul of the builds without AVX-512 BF16 (bf16 weights widened to float32 in registers;
    GEMV up to 4 rows, a GEMM on widened panels beyond, chunks of 96 rows; N not a multiple of 16; strided rows) is
    within one bf16 rounding of the exact product, on the same packed weights the AVX-512 BF16 build reads; the AVX2
    build and the AVX-512 one without BF16 (its GEMM tiles on 16 lanes) give the same bits."""
    from kvserve.kernels import load_variant
    libs = [lib for lib in map(load_variant, kernels.distinct_builds(("no-avx512", "no-avx512bf16")))
            if lib is not None and lib.kvserve_packed_matmul_kind() == 2]
    if not libs:
        pytest.skip("no build that widens bf16 weights here")
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    wp = torch.empty(kernels.packed_numel(n, k), dtype=torch.bfloat16)
    kernels.pack_weight(libs[0], w, wp)
    for m in (1, 2, 3, 4, 5, 8, 13, 25, 97, 200):
        x = torch.randn(m, k + 6, generator=g).to(torch.bfloat16)[:, :k]
        ys = []
        for lib in libs:
            ys.append(torch.empty(m, n, dtype=torch.bfloat16))
            lib.kvserve_packed_matmul_bf16(x.data_ptr(), x.stride(0), wp.data_ptr(), ys[-1].data_ptr(), n, m, n, k)
        exact = x.float() @ w.float().t()
        rounding = (exact.to(torch.bfloat16).float() - exact).abs()
        assert ((ys[0].float() - exact).abs() <= 2 * rounding + 1e-3 * exact.abs().max()).all(), m
        assert all(torch.equal(ys[0], y) for y in ys[1:]), m


@needs_kernels
@pytest.mark.parametrize("n,k", [(100, 48), (960, 576), (33, 64), (40, 50)])
def test_fp16_packed_matmul_widens_exactly(n, k):
    """The fp16 packed matmul (F16C: fp16 weights widened to float32 exactly, for fp16 checkpoints) runs the bf16
    widening matmul's FMAs: on weights that bf16 and fp16 both hold exactly it gives the bf16 kernel's bits, on
    any fp16 weights it is within one bf16 rounding of the exact product, and the AVX2 build and the AVX-512 one
    without BF16 give the same bits."""
    from kvserve.kernels import load_variant
    libs = [lib for lib in map(load_variant, kernels.distinct_builds(("no-avx512", "no-avx512bf16")))
            if lib is not None and lib.kvserve_has_packed_matmul_f16()]
    if not libs:
        pytest.skip("no build with the fp16 widening matmul here")
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g)
    w_bf16 = torch.where(w.abs() < 2 ** -14, 0.0, w).to(torch.bfloat16)   # no fp16 subnormals
    w_exact = w_bf16.to(torch.float16)   # bf16 values of normal fp16 magnitude: held exactly by both
    assert torch.equal(w_exact.float(), w_bf16.float())
    w_any = (torch.randn(n, k, generator=g) * 0.1).to(torch.float16)

    def run(lib, fn, w, x):
        wp = torch.empty(kernels.packed_numel(n, k), dtype=w.dtype)
        kernels.pack_weight(lib, w, wp)
        y = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
        getattr(lib, fn)(x.data_ptr(), x.stride(0), wp.data_ptr(), y.data_ptr(), n, x.shape[0], n, k)
        return y

    for m in (1, 2, 3, 4, 5, 13, 97, 200):
        x = torch.randn(m, k + 6, generator=g).to(torch.bfloat16)[:, :k]
        for lib in libs:
            assert torch.equal(run(lib, "kvserve_packed_matmul_f16", w_exact, x),
                               run(lib, "kvserve_packed_matmul_bf16", w_bf16, x)), m
        ys = [run(lib, "kvserve_packed_matmul_f16", w_any, x) for lib in libs]
        exact = x.float() @ w_any.float().t()
        rounding = (exact.to(torch.bfloat16).float() - exact).abs()
        assert ((ys[0].float() - exact).abs() <= 2 * rounding + 1e-3 * exact.abs().max()).all(), m
        assert all(torch.equal(ys[0], y) for y in ys[1:]), m
