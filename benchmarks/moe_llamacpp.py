"""A mixture of experts against llama.cpp on the same GGUF files, alternating in one run: a random-weight Qwen3-MoE
checkpoint (hidden 1024, 8 layers, 64 experts of 512, top-8; the SmolLM2 tokenizer beside it) converted by
llama.cpp's own convert_hf_to_gguf.py to bf16, and quantized by llama-quantize to Q4_K_M. Single stream: llama-bench
pp256 / tg64 against `kvserve bench latency` 256 in / 64 out. Needs `make peers-llamacpp` (~/peers/llama.cpp-src).

    python benchmarks/moe_llamacpp.py [--rounds 3] [--dir /tmp/moe-llamacpp]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMA = Path(os.environ.get("LLAMA_CPP", Path.home() / "peers" / "llama.cpp-src"))


def make_files(out: Path) -> dict[str, Path]:
    """The HF checkpoint, then llama.cpp's bf16 and Q4_K_M GGUFs of it (kept between runs)."""
    hf, bf16, q4 = out / "hf", out / "moe-bf16.gguf", out / "moe-q4_k_m.gguf"
    if not (hf / "config.json").exists():
        subprocess.run([sys.executable, "-c", f"""
import sys, torch, transformers
sys.path.insert(0, {str(ROOT / 'tests')!r})
from tokenizer_utils import load_smollm2_tokenizer
cfg = transformers.Qwen3MoeConfig(vocab_size=49152, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
    num_key_value_heads=4, head_dim=64, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512,
    intermediate_size=512, norm_topk_prob=True)
torch.manual_seed(0)
m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
with torch.no_grad():
    for n, p in m.named_parameters():
        if n.endswith('mlp.gate.weight'):
            p.normal_(0, 0.5)   # routers with clear margins
m.save_pretrained({str(hf)!r})
load_smollm2_tokenizer().save_pretrained({str(hf)!r})
"""], check=True)
    if not bf16.exists():
        subprocess.run([sys.executable, str(LLAMA / "convert_hf_to_gguf.py"), str(hf), "--outtype", "bf16",
                        "--outfile", str(bf16)], check=True, env={**os.environ, "PYTHONPATH": str(LLAMA / "gguf-py")},
                       capture_output=True)
    if not q4.exists():
        subprocess.run([str(LLAMA / "build" / "bin" / "llama-quantize"), str(bf16), str(q4), "Q4_K_M"], check=True,
                       capture_output=True)
    return {"bf16": bf16, "Q4_K_M": q4}


def llama_bench(path: Path) -> tuple[float, float]:
    """(prefill ms of 256 tokens, ms per token) from llama-bench pp256 / tg64 on 2 threads."""
    out = subprocess.run([str(LLAMA / "build" / "bin" / "llama-bench"), "-m", str(path), "-p", "256", "-n", "64",
                          "-t", "2", "-r", "2"], check=True, capture_output=True, text=True).stdout
    rates = {m.group(1): float(m.group(2)) for m in re.finditer(r"\|\s+(pp256|tg64)\s+\|\s+([\d.]+)", out)}
    return 256e3 / rates["pp256"], 1e3 / rates["tg64"]


def kvserve_bench(path: Path) -> tuple[float, float]:
    """(TTFT ms of 256 tokens, TPOT ms) from `kvserve bench latency` (p50 of 3 runs)."""
    out = subprocess.run([sys.executable, "-m", "kvserve", "bench", "latency", "--model", str(path), "--input-len",
                          "256", "--output-len", "64", "--num-iters", "3", "--num-iters-warmup", "1",
                          "--kv-cache-memory", "256MiB"], check=True, capture_output=True, text=True, cwd=ROOT).stdout
    p50 = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(TTFT|TPOT)\s+ms:.*?p50\s+([\d.]+)", out, re.M)}
    return p50["TTFT"], p50["TPOT"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/moe-llamacpp")
    args = ap.parse_args()
    if not (LLAMA / "build" / "bin" / "llama-bench").exists():
        print(f"no llama.cpp build at {LLAMA}: make peers-llamacpp")
        return 1
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    files = make_files(out)
    print("| file | round | llama.cpp prefill 256 ms | kvserve TTFT 256 ms | llama.cpp ms/token | kvserve TPOT ms |")
    print("|---|---|---|---|---|---|")
    for r in range(args.rounds):   # alternating: the machine's drift hits both alike
        for name, path in files.items():
            (lp, lt), (kp, kt) = llama_bench(path), kvserve_bench(path)
            print(f"| {name} | {r + 1} | {lp:.0f} | {kp:.0f} | {lt:.2f} | {kt:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
