"""Tensor parallelism (kvserve/distributed): the shard plan, the step message, TP=2 against TP=1 through the engine
(two processes over gloo), the fused C++ stack against the modules on every rank, and the failures."""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.distributed.comm import TPComm, create_shm_segment
from kvserve.distributed.message import StepMessage
from kvserve.distributed.plan import check_world, make_plans, shard_tensor
from kvserve.errors import EngineDeadError, InvalidRequestError
from kvserve.model import ModelConfig, load_model
from kvserve.model.quantization import FORMAT_IDS, QuantizedTensor, quantize_q8_0
from model_utils import save_tiny_model
from test_lora import expected, models  # noqa: F401 - fixtures
from tokenizer_utils import load_smollm2_tokenizer

GREEDY = SamplingParams(max_tokens=10, temperature=0, logprobs=2, ignore_eos=True)


def _cfg(heads: int, kv_heads: int, intermediate: int = 1536, vocab: int = 49152) -> ModelConfig:
    return ModelConfig.from_hf_config({"architectures": ["LlamaForCausalLM"], "vocab_size": vocab,
                                       "hidden_size": 64 * heads, "intermediate_size": intermediate,
                                       "num_hidden_layers": 2, "num_attention_heads": heads,
                                       "num_key_value_heads": kv_heads})


def test_plans_deal_heads_by_kv_group():
    # SmolLM2-135M: 9 heads in 3 KV groups, over 2 ranks: groups 2 + 1
    a, b = make_plans(_cfg(9, 3), 2)
    assert (a.q_heads, a.kv_heads, b.q_heads, b.kv_heads) == ((0, 6), (0, 2), (6, 3), (2, 1))
    assert (a.intermediate, b.intermediate) == ((0, 768), (768, 768))   # whole 256-value blocks
    assert (a.vocab, b.vocab, a.vocab_per_rank) == ((0, 24576), (24576, 24576), 24576)
    # fewer KV heads than ranks: each KV head replicated, its group's query heads split
    plans = make_plans(_cfg(8, 2), 4)
    assert [p.kv_heads for p in plans] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [p.q_heads for p in plans] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    # an odd vocabulary: the last rank's slice is short; an intermediate that only 32 divides
    plans = make_plans(_cfg(4, 4, intermediate=4864 + 32, vocab=1001), 3)
    assert [p.vocab for p in plans] == [(0, 334), (334, 334), (668, 333)]
    assert sum(p.intermediate[1] for p in plans) == 4896 and all(p.intermediate[1] % 32 == 0 for p in plans)
    local = plans[2].local_config(_cfg(4, 4, vocab=1001))
    assert (local.num_attention_heads, local.vocab_size, local.head_dim) == (1, 333, 64)


def test_plans_refuse_what_does_not_split():
    with pytest.raises(InvalidRequestError, match="does not divide") as e:
        make_plans(_cfg(9, 3), 4)
    assert e.value.param == "tensor_parallel_size"
    with pytest.raises(InvalidRequestError, match="does not divide"):
        make_plans(_cfg(6, 2), 4)   # 2 KV heads over 4 ranks, but groups of 3 query heads do not halve
    with pytest.raises(InvalidRequestError, match="cores"):
        check_world(3, 2, "mp")
    check_world(3, 2, "ray")   # Ray places ranks on the cluster's machines


def test_shard_tensor_slices_quantized_blocks():
    plan = make_plans(_cfg(4, 2, intermediate=512), 2)[1]
    w = torch.randn(64 * 4, 512)
    q = quantize_q8_0(w)
    down = shard_tensor("model.layers.0.mlp.down_proj.weight", q, plan)   # input columns 256..511: whole blocks
    assert isinstance(down, QuantizedTensor) and down.shape == (256, 256)
    assert torch.equal(down.dequantize(), q.dequantize()[:, 256:])
    up = shard_tensor("model.layers.0.mlp.up_proj.weight", q, plan)
    assert torch.equal(up.dequantize(), q.dequantize()[256:512])
    # 8 heads over 3 ranks: rank 1's o_proj input columns are 192..383, whole Q8_0 blocks but not Q4_K super-blocks
    o = QuantizedTensor(FORMAT_IDS["Q4_K"], torch.zeros(512, 144 * 2, dtype=torch.uint8), 512)
    split = shard_tensor("model.layers.0.self_attn.o_proj.weight", o, make_plans(_cfg(8, 8), 3)[1])
    assert isinstance(split, torch.Tensor) and split.shape == (512, 192)   # dequantized rather than cut mid-block
    norm = torch.randn(64)
    assert shard_tensor("model.layers.0.input_layernorm.weight", norm, plan) is norm


def test_a_rank_loads_its_shard_of_the_bundled_gguf_kept_quantized():
    """Rank 1 of 2 (no group: only the load): 3 of the 9 heads, half the MLP and vocabulary, every matrix still in
    the file's blocks (Q4_1, the Q8_0 embedding), each holding its rows of the whole model's."""
    config = EngineConfig(dtype="float32", quantization="gguf")
    plans = []
    shard, cfg = load_model(config, shard=lambda c: plans.extend(make_plans(c, 2)) or plans[1])
    whole, _ = load_model(config)
    attn, mlp = shard.model.layers[0].self_attn, shard.model.layers[0].mlp
    assert (attn.num_heads, attn.num_kv_heads, cfg.num_attention_heads) == (3, 1, 9)
    assert attn.qkv_proj.quantized.formats() == ["Q4_1"] and mlp.down_proj.quantized.in_features == 768
    assert mlp.gate_up_proj.quantized.out_features == 2 * 768 and shard.model.embed_tokens.weight.shape[0] == 24576
    embed = shard.model.embed_tokens.quantized.segments[0]
    assert torch.equal(embed.data, whole.model.embed_tokens.quantized.segments[0].data[24576:])
    down = mlp.down_proj.quantized.dequantize()
    assert torch.equal(down, whole.model.layers[0].mlp.down_proj.quantized.dequantize()[:, 768:])


def test_step_message_round_trips_as_plain_arrays():
    msg = StepMessage.build([5, 6, 7, 8], np.array([0, 1, 2, 9]), [3, 1], [3, 10], [[4, 2], [7]], [(1, 3)],
                            [np.arange(2), np.array([2, 3])])
    data = msg.encode()
    assert b"kvserve" not in data and b"Request" not in data   # arrays and a JSON header, no pickled objects
    back = StepMessage.decode(data)
    for name in ("input_ids", "positions", "query_lens", "seq_lens", "block_copies"):
        assert np.array_equal(getattr(back, name), getattr(msg, name))
    assert back.tables() == [[4, 2], [7]] and [r.tolist() for r in back.logits_calls()] == [[0, 1], [2, 3]]
    assert back.num_tokens == 4 and back.block_copies.shape == (1, 2)
    with pytest.raises(ValueError):
        StepMessage.decode(data + b"x")


def test_parallel_settings_are_validated():
    for kwargs, param in (({"tensor_parallel_size": 0}, "tensor_parallel_size"),
                          ({"pipeline_parallel_size": 2}, "pipeline_parallel_size"),
                          ({"distributed_executor_backend": "slurm"}, "distributed_executor_backend"),
                          ({"tensor_parallel_size": 2, "kv_cache_dtype": "fp8", "calculate_kv_scales": True},
                           "calculate_kv_scales")):
        with pytest.raises(InvalidRequestError) as e:
            EngineConfig(**kwargs)
        assert e.value.param == param
    with pytest.raises(InvalidRequestError, match="does not divide"):   # before any process starts
        LLM(tensor_parallel_size=4)


def test_more_local_ranks_than_cores_are_refused(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    with pytest.raises(InvalidRequestError, match="more ranks than this machine's 2 cores"):
        LLM(tensor_parallel_size=3)   # 3 KV heads: the split itself is fine


def _outputs(llm, prompts, params=GREEDY):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _assert_same(got, want, tol=2e-3):
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got, want):
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.keys() == y.keys()
            assert all(abs(x[t].logprob - y[t].logprob) < tol for t in x)


def test_tp2_equals_tp1_on_the_bundled_model():
    """float32 greedy tokens and logprobs under chunked prefill (32-token steps), a shared prefix from the prefix
    cache, preemptions (an 8-block pool) and a batch of 3; prompt logprobs too (every rank computes its slice)."""
    prefix = "You are a careful assistant. Answer in one short sentence, and do not add anything else. "
    prompts = [prefix + q for q in ("What is the capital of France?", "Name a prime number.", "What is 2 + 3?")]
    kwargs = dict(dtype="float32", quantization="none", max_num_batched_tokens=32, num_kv_blocks=8,
                  block_size=8)
    threads = torch.get_num_threads()
    tp = LLM(tensor_parallel_size=2, **kwargs)
    try:
        got = _outputs(tp, prompts)
        lp = tp.generate(prompts[0], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
        stats = tp.llm_engine.scheduler
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
        assert "tensor parallel 2 (mp, shared-memory all-reduce, 1 thread per rank)" in \
            tp.llm_engine.parallel_description()
    finally:
        tp.llm_engine.shutdown()
    assert torch.get_num_threads() == threads   # the process's thread count is given back
    one = LLM(**kwargs)
    _assert_same(got, _outputs(one, prompts))
    want = one.generate(prompts[0], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    assert all(abs(a[t].logprob - b[t].logprob) < 2e-3 for a, b in zip(lp.prompt_logprobs[1:],
                                                                     want.prompt_logprobs[1:]) for t in a)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """Random tiny Qwen3 (q/k norms, head_dim 32) and Qwen2 (q|k|v biases, tied embeddings), SmolLM2 tokenizer."""
    root = tmp_path_factory.mktemp("tp")
    paths = {}
    for family, extra in (("qwen3", {}), ("qwen2", {"tie_word_embeddings": True})):
        save_tiny_model(family, root / family, intermediate_size=96, **extra)
        load_smollm2_tokenizer().save_pretrained(str(root / family))
        paths[family] = str(root / family)
    return paths


PROMPTS = [{"prompt_token_ids": [3 + (7 * i + j) % 250 for j in range(5 + 9 * i)]} for i in range(4)]


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_tp2_equals_tp1_on_tiny_qwen(tiny_models, family, monkeypatch):
    kwargs = dict(model=tiny_models[family], dtype="float32", max_num_batched_tokens=16, block_size=4,
                  num_kv_blocks=14)
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=2, ignore_eos=True)
    one = LLM(**kwargs)
    want = _outputs(one, PROMPTS, params)
    # qwen2 also verifies n-gram drafts (k + 1 rows per request through the gathered logits)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "disable_by_batch_size": None}
    tp = LLM(tensor_parallel_size=2, speculative_config=spec if family == "qwen2" else None, **kwargs)
    try:
        _assert_same(_outputs(tp, PROMPTS, params), want, tol=1e-4)
        assert family == "qwen3" or tp.llm_engine.scheduler.spec_stats.num_drafts > 0
        assert tp.llm_engine.scheduler.num_preemptions > 0   # 14 blocks of 4 tokens for 4 requests
        # seeded sampling draws on the driver only: the same tokens as one process
        seeded = SamplingParams(max_tokens=8, temperature=0.8, seed=7, ignore_eos=True)
        assert [o.token_ids for o in _outputs(tp, PROMPTS[:2], seeded)] == \
            [o.token_ids for o in _outputs(one, PROMPTS[:2], seeded)]
        if family == "qwen2":
            _check_worker_death(tp)
        else:
            _check_driver_failure(tp, monkeypatch)
    finally:
        tp.llm_engine.shutdown()


@pytest.mark.parametrize("family", ["gemma3", "phi3"])
def test_tp2_equals_tp1_on_other_families(tmp_path, family):
    """Families declared beside Llama's: Gemma 3 (sandwich norms, windows, two RoPE tables, q/k norm), Phi-3 (fused
    projections in the checkpoint, split before the ranks take their slices)."""
    save_tiny_model(family, tmp_path, intermediate_size=96, **({"sliding_window": 8} if family == "phi3" else {}))
    # Gemma 3's blocks are pages of one layer (3 KV groups of 1): a pool of 40 still preempts
    check_tp2_equals_tp1(tmp_path, num_kv_blocks=40 if family == "gemma3" else 14)


def check_tp2_equals_tp1(path, num_kv_blocks: int) -> None:
    """The tiny checkpoint at `path` (the SmolLM2 tokenizer saved beside it here) gives the same tokens and
    logprobs over two ranks as in one process, with chunked prefill and a pool small enough to preempt."""
    load_smollm2_tokenizer().save_pretrained(str(path))
    kwargs = dict(model=str(path), dtype="float32", max_num_batched_tokens=16, block_size=4,
                  num_kv_blocks=num_kv_blocks)
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=2, ignore_eos=True)
    one = LLM(**kwargs)
    want = _outputs(one, PROMPTS, params)
    assert one.llm_engine.scheduler.num_preemptions > 0
    tp = LLM(tensor_parallel_size=2, **kwargs)
    try:
        _assert_same(_outputs(tp, PROMPTS, params), want, tol=1e-4)
    finally:
        tp.llm_engine.shutdown()


def _check_worker_death(llm):
    """A worker that dies is reported at once, also while idle; the next step raises EngineDeadError, no hang."""
    engine = llm.llm_engine
    told = threading.Event()
    engine.executor.on_dead.append(lambda message: told.set())
    engine.executor._procs[0].kill()
    assert told.wait(10) and "rank 1" in engine.executor.dead_error
    start = time.monotonic()
    with pytest.raises(EngineDeadError):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    assert time.monotonic() - start < 10


def test_tp2_with_a_draft_model_equals_no_speculation(tmp_path, gguf_path):
    """The draft model runs whole on rank 0, its KV beside rank 0's shard; copy-on-write copies its proposals make
    (n=2 samples fork a shared block) reach the other rank before its next step. Greedy output equals one process
    without speculation, under chunked prefill, preemption and prefix caching."""
    from spec_utils import STRESS, save_first_layer_draft, tiny_prompts
    save_tiny_model("qwen2", tmp_path / "target", num_hidden_layers=3, vocab_size=96)
    save_first_layer_draft(tmp_path / "target", tmp_path / "draft")
    kwargs = dict(model=str(tmp_path / "target"), tokenizer=gguf_path, dtype="float32", **STRESS)
    prompts = tiny_prompts(4)
    params = SamplingParams(n=2, temperature=0, max_tokens=20, ignore_eos=True)
    want = [[c.token_ids for c in o.outputs] for o in LLM(**kwargs).generate(prompts, params, use_tqdm=False)]
    spec = {"model": str(tmp_path / "draft"), "num_speculative_tokens": 3, "disable_by_batch_size": None}
    tp = LLM(tensor_parallel_size=2, speculative_config=spec, **kwargs)
    sent = []
    send = tp.llm_engine.executor.send_block_copies
    tp.llm_engine.executor.send_block_copies = lambda copies: (sent.append(copies), send(copies))
    try:
        got = [[c.token_ids for c in o.outputs] for o in tp.generate(prompts, params, use_tqdm=False)]
        stats = tp.llm_engine.scheduler.spec_stats
    finally:
        tp.llm_engine.shutdown()
    assert got == want
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens and sent


def test_tp2_serves_lora_adapters_equal_to_peft(models, expected):
    """Each rank holds its part of every adapter (B's output rows of a column-parallel projection, A's input
    columns of a row-parallel one; the all-reduce sums the partial products) in slots that mirror the driver's:
    a batch mixing the base model and three adapters in two slots (so slots are rewritten between steps) equals
    transformers + peft."""
    from test_lora import PROMPTS as LORA_PROMPTS, run
    root, _, requests = models
    tp = LLM(str(root / "base"), dtype="float32", enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=8,
             num_kv_blocks=64, max_num_seqs=2, tensor_parallel_size=2)
    names = [None, "qvd", "all", "kogu", "all", None, "qvd", "kogu"]
    prompts = [LORA_PROMPTS[i % len(LORA_PROMPTS)] for i in range(len(names))]
    try:
        got = run(tp, [requests[n] if n else None for n in names], prompts)
        assert tp.llm_engine.lora.num_slot_writes > 2   # two slots, three adapters: rewritten, and mirrored
    finally:
        tp.llm_engine.shutdown()
    for (tokens, logprobs), (name, i) in zip(got, [(n, i % len(LORA_PROMPTS)) for i, n in enumerate(names)]):
        want_tokens, want_logprobs = expected[name][i]
        assert tokens == want_tokens
        np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-3)


def _check_driver_failure(llm, monkeypatch):
    """Rank 0 failing inside a step, while rank 1 waits in the step's all-reduce: the engine is dead (the ranks
    cannot be paired up again), rank 1 is woken and exits, nothing hangs."""
    from kvserve.errors import RequestFailedError
    from kvserve.model.decoder import DecoderMLP

    def broken(*args):
        raise RuntimeError("injected")
    # after the step's last collective (sampling): its requests fail, as on one process, and the group goes on
    runner = llm.llm_engine.runner
    with monkeypatch.context() as m:
        m.setattr(runner, "_sample", broken)
        with pytest.raises(RequestFailedError):
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids) == 3
    monkeypatch.setattr(DecoderMLP, "__call__", broken)   # inside the forward, in this process only: rank 0
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="rank 0 failed in the middle of a step"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.llm_engine.executor._procs[0].wait(timeout=10) != 0   # woken in its all-reduce: it gave up
    assert time.monotonic() - start < 10


def _model_cls():
    from kvserve.model.decoder import DecoderModel
    return DecoderModel


def _random_lora_slot(model, plan, cfg, seed: int) -> None:
    """Slot 0 of a rank's adapter tables: a random rank-4 adapter on every projection."""
    from kvserve.lora.manager import LoRAManager
    manager = LoRAManager(model, max_loras=1, max_lora_rank=4, max_cpu_loras=1, shard=plan, full_config=cfg)
    g = torch.Generator().manual_seed(seed)
    for table in manager.tables.values():
        k = table.a.shape[-1]
        for shard in range(len(table.offsets) - 1):
            n = int(table.offsets[shard + 1] - table.offsets[shard])
            table.set_slot(0, shard, torch.randn(4, k, generator=g) * 0.3, torch.randn(n, 4, generator=g) * 0.3)


def test_fused_stack_equals_the_modules_on_every_rank(tmp_path, monkeypatch):
    """Two ranks as threads of this process, each with its shard of an int8 Qwen2 in bf16 and a LoRA adapter on
    every other row: the fused C++ stack (its all-reduce hook calling the group's shared-memory all-reduce) and the
    modules give bit-identical logits and pools on every rank (every linear int8: the stack runs on AVX2 too)."""
    from kvserve import kernels
    lib = kernels.load()
    if lib is None:
        pytest.skip("no C++ kernels")
    save_tiny_model("qwen2", tmp_path / "m", hidden_size=128, intermediate_size=96)
    config = EngineConfig(model=str(tmp_path / "m"), dtype="bfloat16", device="cpu", quantization="int8")
    if not lib.silu_mul_fast:
        pytest.skip("the fused stack needs AVX2 or AVX-512 BF16")
    store = TPComm.make_store("127.0.0.1", 2)
    shm = create_shm_segment(2)
    try:
        _run_two_ranks(config, store, shm, monkeypatch)
    finally:
        os.unlink(shm)


def _run_two_ranks(config, store, shm, monkeypatch):
    import test_fused_layers as fused_tests
    results, errors = {}, []

    def rank(r):
        try:
            comm = TPComm("127.0.0.1", store.port, r, 2, torch.device("cpu"), store=store if r == 0 else None,
                          shm_path=shm)
            plans = []
            model, cfg = load_model(config, shard=lambda c: plans.extend(make_plans(c, 2)) or plans[r])
            model.set_tensor_parallel(comm, plans[r].vocab[0], plans[r].vocab_per_rank, cfg.vocab_size)
            model.prepack()
            _random_lora_slot(model, plans[r], cfg, seed=r)
            runs = []
            for fused in (True, False):
                model.model.use_fused_layers = fused
                runs.append(fused_tests._run_steps(model, 16))
                fused_stack = model.model._fused
                assert fused_stack is not None and fused_stack.tp is comm and fused_stack.has_lora
            results[r] = runs
        except Exception as e:   # noqa: BLE001 - reported below
            errors.append(e)

    # every call marks its rows by position: base model, adapter slot 0, base ... (LoRA before the all-reduce)
    real_forward = _model_cls().forward

    def forward(self, input_ids, positions, meta):
        self.lora_mapping.set(np.array([(-1, 0)[int(p) % 2] for p in positions], np.int32), torch.device("cpu"))
        try:
            return real_forward(self, input_ids, positions, meta)
        finally:
            self.lora_mapping.clear()
    monkeypatch.setattr(_model_cls(), "__call__", forward)   # InferenceModule calls go straight to forward
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for r in range(2):
        (fused_logits, fused_pools), (module_logits, module_pools) = results[r]
        assert all(torch.equal(a, b) for a, b in zip(fused_pools, module_pools))
        if r == 0:
            assert all(torch.isfinite(x).all() for x in fused_logits)
            assert all(torch.equal(a, b) for a, b in zip(fused_logits, module_logits))
        else:
            assert fused_logits == module_logits == [None] * len(fused_logits)   # logits are gathered to rank 0
