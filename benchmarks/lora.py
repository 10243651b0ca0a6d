"""Multi-LoRA cost, side by side in one process on the bundled model (or --model): throughput of a batch whose
requests use 8 different adapters against the same batch on the base model (and on an engine without LoRA),
single-stream TPOT with and without an adapter, and the time to load an adapter from disk and put it in a slot.

    python benchmarks/lora.py [--model PATH] [--rank 16] [--num-prompts 64] [--output-json FILE]

The adapters are PEFT directories written here: random A and B of the given rank on all seven projections
(q, k, v, o, gate, up, down), the costliest target set. Machines of this kind differ from day to day: read the
ratios, measured in one run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvserve import LLM, LoRARequest, SamplingParams
from kvserve.lora.adapter import load_adapter

MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(path: Path, shapes: dict[str, tuple[int, int]], num_layers: int, rank: int, seed: int) -> Path:
    """A PEFT adapter directory with random weights of `rank` on every projection (shapes: module -> (in, out))."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for module, (k, n) in shapes.items():
            stem = f"base_model.model.model.layers.{layer}.{MODULES[module]}.{module}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, k, generator=gen) / k ** 0.5
            tensors[f"{stem}.lora_B.weight"] = torch.randn(n, rank, generator=gen) * 0.01
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                         "target_modules": list(MODULES)}))
    return path


def model_shapes(llm: LLM) -> tuple[dict[str, tuple[int, int]], int]:
    cfg = llm.llm_engine.model_config
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv, i = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
            "up_proj": (h, i), "down_proj": (i, h)}, cfg.num_hidden_layers


def throughput(llm: LLM, prompts: list[list[int]], loras, output_len: int) -> float:
    """Output tokens per second of one generate() call over every prompt."""
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def tpot_ms(llm: LLM, prompt: list[int], lora, output_len: int = 65, iters: int = 3) -> float:
    """Single-stream time per output token: (time to output_len tokens - time to 1 token) / (output_len - 1)."""
    def run(n):
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                     use_tqdm=False, lora_request=lora)
        return time.perf_counter() - start
    run(2)   # warm-up
    return statistics.median((run(output_len) - run(1)) * 1000 / (output_len - 1) for _ in range(iters))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num-adapters", type=int, default=8)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    common = dict(enable_prefix_caching=False, max_num_seqs=args.num_prompts)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 20000, (args.input_len,), generator=gen).tolist() for _ in range(args.num_prompts)]
    result = {"rank": args.rank, "num_adapters": args.num_adapters, "num_prompts": args.num_prompts,
              "input_len": args.input_len, "output_len": args.output_len}

    plain = LLM(args.model, **common)
    llm = LLM(args.model, enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank,
              max_cpu_loras=args.num_adapters, **common)
    shapes, num_layers = model_shapes(plain)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [LoRARequest(f"a{i}", i + 1, str(write_adapter(Path(tmp) / f"a{i}", shapes, num_layers,
                                                                   args.rank, i)))
                    for i in range(args.num_adapters)]
        engine = llm.llm_engine
        loads = []
        for a in adapters:
            start = time.perf_counter()
            load_adapter(a, engine.lora.shapes, engine.lora.num_layers, args.rank)
            loads.append(time.perf_counter() - start)
        result["load_ms"] = statistics.median(loads) * 1000
        adapter = engine.lora.load(adapters[0])
        start = time.perf_counter()
        engine.lora._write_slot(0, adapter)
        result["slot_write_ms"] = (time.perf_counter() - start) * 1000
        throughput(plain, prompts[:4], None, 4)   # warm-up
        throughput(llm, prompts[:8], adapters, 2)   # warm-up, and every adapter into memory
        mixed = [adapters[i % len(adapters)] for i in range(len(prompts))]
        result["no_lora_tok_s"] = throughput(plain, prompts, None, args.output_len)
        result["base_tok_s"] = throughput(llm, prompts, None, args.output_len)
        result["mixed_tok_s"] = throughput(llm, prompts, mixed, args.output_len)
        # single stream: the three measured in turn, 3 rounds, medians (this machine's noise is a few %)
        tpots = {"no_lora": [], "base": [], "adapter": []}
        for _ in range(3):
            tpots["no_lora"].append(tpot_ms(plain, prompts[0], None, iters=1))
            tpots["base"].append(tpot_ms(llm, prompts[0], None, iters=1))
            tpots["adapter"].append(tpot_ms(llm, prompts[0], adapters[0], iters=1))
        for name, values in tpots.items():
            result[f"{name}_tpot_ms"] = statistics.median(values)
    result["mixed_over_base"] = result["mixed_tok_s"] / result["base_tok_s"]
    result["mixed_over_no_lora"] = result["mixed_tok_s"] / result["no_lora_tok_s"]
    result["tpot_overhead"] = result["adapter_tpot_ms"] / result["base_tpot_ms"]
    print(f"throughput, {args.num_prompts} requests: no LoRA {result['no_lora_tok_s']:.1f} tok/s, base on the LoRA "
          f"engine {result['base_tok_s']:.1f}, {args.num_adapters} adapters {result['mixed_tok_s']:.1f} "
          f"({result['mixed_over_base']:.2f}x base, {result['mixed_over_no_lora']:.2f}x no LoRA)")
    print(f"TPOT batch 1: no LoRA {result['no_lora_tpot_ms']:.2f} ms, base {result['base_tpot_ms']:.2f} ms, adapter "
          f"{result['adapter_tpot_ms']:.2f} ms ({result['tpot_overhead']:.2f}x)")
    print(f"adapter load (rank {args.rank}, all projections) {result['load_ms']:.1f} ms, into a slot "
          f"{result['slot_write_ms']:.1f} ms")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
