"""The cost of routing: a mixture of experts against a dense model with the same active parameters, side by side in
one process (random weights, bf16 or float32). Decode step time at batch 1 and 16 once every request decodes, and
prefill time, for

  - the MoE: Qwen3-MoE layers, E experts of I each, top-k (its MLPs run as moe.py's grouped experts);
  - the dense model: the same attention and hidden size, one MLP of k * I (the same active parameters), through
    the layer modules and, where it runs, the fused C++ stack.

    python benchmarks/moe_overhead.py [--hidden 1024] [--layers 8] [--experts 64] [--expert-size 512] [--top-k 8]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvserve import LLM, SamplingParams   # noqa: E402
from kvserve.model import default_model_path   # noqa: E402
from kvserve.model.moe import moe_layers   # noqa: E402


def make_checkpoint(root: Path, name: str, args, moe: bool) -> Path:
    """A random-weight Qwen3(-MoE) checkpoint in bf16."""
    import transformers
    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 256), head_dim=64,
                  max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if moe:
        config = transformers.Qwen3MoeConfig(**common, num_experts=args.experts, num_experts_per_tok=args.top_k,
                                             moe_intermediate_size=args.expert_size, intermediate_size=args.expert_size,
                                             norm_topk_prob=True)
    else:
        config = transformers.Qwen3Config(**common, intermediate_size=args.top_k * args.expert_size)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if moe:   # routers with clear margins, as trained ones have
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("mlp.gate.weight"):
                    p.normal_(0, 0.5)
    path = root / name
    model.save_pretrained(str(path))
    return path


def decode_step_ms(llm, batch: int, steps: int, prompt_len: int = 64) -> float:
    """Median ms of an engine step once `batch` requests all decode."""
    engine = llm.llm_engine
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        ids = torch.randint(3, engine.vocab_size, (prompt_len,), generator=g).tolist()
        engine.add_request(f"b{batch}-{time.monotonic_ns()}-{i}", {"prompt_token_ids": ids},
                           SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                          for r in engine.scheduler.running):
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times) * 1e3


def prefill_ms(llm, tokens: int) -> float:
    ids = torch.randint(3, llm.llm_engine.vocab_size, (tokens,), generator=torch.Generator().manual_seed(7)).tolist()
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return (time.perf_counter() - t) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--expert-size", type=int, default=512)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as root:
        paths = {"moe": make_checkpoint(Path(root), "moe", args, True),
                 "dense": make_checkpoint(Path(root), "dense", args, False)}
        llms = {k: LLM(model=str(p), tokenizer=default_model_path(), dtype=args.dtype,   # (its tokenizer: any)
                       max_model_len=1024, max_num_seqs=16, enable_prefix_caching=False)
                for k, p in paths.items()}
        print(f"MoE: {llms['moe'].llm_engine.weights_summary}")
        print(f"dense: {llms['dense'].llm_engine.weights_summary}; {llms['dense'].llm_engine.kernel_summary}")
        variants = [("moe", True), ("dense", True), ("moe", False), ("dense", False)]
        results: dict = {v: {"b1": [], "b16": [], "prefill": []} for v in variants}
        for _ in range(args.rounds):   # interleaved: the machine's drift hits every variant alike
            for name, fused in variants:
                llm = llms[name]
                llm.llm_engine.model.model.use_fused_layers = fused
                r = results[(name, fused)]
                r["b1"].append(decode_step_ms(llm, 1, args.steps))
                r["b16"].append(decode_step_ms(llm, 16, args.steps))
                r["prefill"].append(prefill_ms(llm, 512))
        blocks = moe_layers(llms["moe"].llm_engine.model)
        print(f"{len(blocks)} MoE layers, {args.experts} experts of {args.expert_size}, top-{args.top_k}; dense MLP "
              f"{args.top_k * args.expert_size}; {args.dtype}; medians of {args.rounds} rounds")
        print("| model | decode step b=1 ms | b=16 ms | prefill 512 tokens ms |")
        print("|---|---|---|---|")
        for (name, fused), r in results.items():
            path = "fused stack" if fused else "layer modules"
            print(f"| {'MoE' if name == 'moe' else 'dense'} ({path}) | {statistics.median(r['b1']):.2f} | "
                  f"{statistics.median(r['b16']):.2f} | {statistics.median(r['prefill']):.1f} |")
        for fused in (True, False):
            moe, dense = results[("moe", fused)], results[("dense", fused)]
            print(f"MoE / dense ({'fused stack' if fused else 'layer modules'}): " + ", ".join(
                f"{k} {statistics.median(moe[k]) / statistics.median(dense[k]):.2f}x"
                for k in ("b1", "b16", "prefill")))
        # what a decode step must read: at batch B a uniformly routed layer touches E (1 - (1 - k/E)^B) experts
        e, k = args.experts, args.top_k
        touched = e * (1 - (1 - k / e) ** 16)
        print(f"batch 16: about {touched:.1f} of {e} experts touched per layer (uniform routing), so the MoE reads "
              f"about {touched / k:.1f}x the dense model's MLP weights per step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
