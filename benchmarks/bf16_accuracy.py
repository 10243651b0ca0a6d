"""How close bf16 stays to float32 with each CPU kernel switched in or out, in one process.

  python benchmarks/bf16_accuracy.py

10 prompts (6 plain texts, 4 chat prompts) get 64 greedy tokens from the float32 engine (the configuration
tests/test_engine_equivalence.py checks against transformers). Each bf16 configuration then reads prompt +
continuation as one prompt with prompt_logprobs (teacher forcing) and reports, over the 640 continuation
positions, how often float32's greedy token is also bf16's top-1, and the mean and max |logprob difference| of
that token. Unlike "first divergence of free-running greedy output", this does not hinge on one near-tie.
"""
from __future__ import annotations

import numpy as np

from kvserve import LLM, SamplingParams
from kvserve.attention import CpuPagedAttention, TorchPagedAttention, attention_layers
from kvserve.model import layers, linear_method

PLAIN = ["The history of the printing press", "In a small village by the sea, there lived", "def fibonacci(n):",
         "The three laws of thermodynamics are", "Once upon a time, a robot",
         "The capital of France is Paris. The capital of Italy is"]
CHAT = ["What is the boiling point of water?", "Write a haiku about autumn.",
        "Explain photosynthesis in one sentence.", "List three prime numbers."]


def prompt_ids(llm: LLM) -> list[list[int]]:
    tok = llm.llm_engine.tokenizer
    out = [tok.encode(p) for p in PLAIN]
    for c in CHAT:
        ids = tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True)
        out.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return out


def teacher_forced(llm: LLM, prompts: list[list[int]], continuations: list[list[int]]):
    """(logprob, rank) of each continuation token given everything before it."""
    full = [{"prompt_token_ids": p + c} for p, c in zip(prompts, continuations)]
    outs = llm.generate(full, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    lps, ranks = [], []
    for p, o in zip(prompts, outs):
        for pos in range(len(p), len(o.prompt_token_ids)):
            lp = o.prompt_logprobs[pos][o.prompt_token_ids[pos]]
            lps.append(lp.logprob)
            ranks.append(lp.rank)
    return np.array(lps), np.array(ranks)


def main() -> None:
    fp32 = LLM(dtype="float32", quantization="none")
    prompts = prompt_ids(fp32)
    outs = fp32.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    continuations = [list(o.outputs[0].token_ids) for o in outs]
    ref, _ = teacher_forced(fp32, prompts, continuations)
    del fp32

    llm = LLM(dtype="bfloat16", quantization="none")
    model = llm.llm_engine.model
    layers.restore_unpacked_weights(model)   # for oneDNN's packs and the unpacked configurations
    linears = [m for m in model.modules() if isinstance(m, layers.Linear)]
    kernel_packs = [m.method for m in linears] + [model.tied_head]
    onednn_packs = linear_method.prepack_weights([m.weight for m in linears] + [model.model.embed_tokens.weight],
                                          onednn=True)
    fast_lib = layers._fast_lib

    def configure(attention, packs, fused: bool) -> None:
        for a in attention_layers(model):
            a.backend = attention
        for m, p in zip(linears, packs or [linear_method.DENSE] * len(linears)):
            m.method = p
        model.tied_head = packs[-1] if packs else linear_method.DENSE
        layers._fast_lib = fast_lib if fused else (lambda x: None)

    configs = {
        "default: tiled attention + C++ matmuls + fused ops": (CpuPagedAttention(), kernel_packs, True),
        "torch attention + C++ matmuls + fused ops": (TorchPagedAttention(), kernel_packs, True),
        "tiled attention + oneDNN matmuls + fused ops": (CpuPagedAttention(), onednn_packs, True),
        "torch attention + oneDNN matmuls + fused ops": (TorchPagedAttention(), onednn_packs, True),
        "torch ops only (F.linear, torch attention, unfused ops)": (TorchPagedAttention(), None, False),
    }
    print(f"{'bf16 configuration':<58} {'top-1 = fp32':>12} {'mean |dlp|':>10} {'max |dlp|':>9}")
    for name, cfg in configs.items():
        configure(*cfg)
        lp, rank = teacher_forced(llm, prompts, continuations)
        diff = np.abs(lp - ref)
        print(f"{name:<58} {np.mean(rank == 1):12.4f} {diff.mean():10.4f} {diff.max():9.3f}")


if __name__ == "__main__":
    main()
