"""Embedding throughput, side by side in one process: kvserve's LLM.embed against sentence-transformers'
encode on the same model (all-MiniLM-L6-v2: installed by make setup, or --model DIR),
float32 both, the same sentences (random words, --tokens tokens each), batches of --batch, alternating runs.

    python benchmarks/embeddings.py [--batch 64] [--tokens 32] [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvserve import LLM   # noqa: E402


def sentences(tokenizer, n: int, tokens: int, seed: int) -> list[str]:
    """n texts of `tokens` tokens each ([CLS] and [SEP] included) from random vocabulary words."""
    rng = random.Random(seed)
    words = [w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 2]
    out = []
    while len(out) < n:
        text = " ".join(rng.choice(words) for _ in range(tokens - 2))
        ids = tokenizer.encode(text)
        if len(ids) >= tokens:
            out.append(tokenizer.decode(ids[1:tokens - 1]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a sentence-transformers folder (default: the fetched MiniLM)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=str(Path(__file__).parent / "results/embeddings.json"))
    args = p.parse_args()
    from sentence_transformers import SentenceTransformer
    from kvserve.model.loader import packaged_model_path
    path = args.model or str(packaged_model_path("all-MiniLM-L6-v2"))
    st = SentenceTransformer(path, device="cpu")
    llm = LLM(model=path, dtype="float32")
    texts = sentences(llm.get_tokenizer(), args.batch, args.tokens, 0)
    st.encode(texts, batch_size=args.batch)
    llm.embed(texts, use_tqdm=False)
    times = {"kvserve": [], "sentence-transformers": []}
    for r in range(args.rounds):
        for name in (times if r % 2 == 0 else reversed(list(times))):
            start = time.perf_counter()
            if name == "kvserve":
                got = llm.embed(texts, use_tqdm=False)
            else:
                want = st.encode(texts, batch_size=args.batch, convert_to_tensor=True)
            times[name].append(time.perf_counter() - start)
    cos = torch.nn.functional.cosine_similarity(torch.tensor([o.outputs.embedding for o in got]), want.float())
    rates = {name: args.batch / statistics.median(t) for name, t in times.items()}
    ratio = rates["kvserve"] / rates["sentence-transformers"]
    for name, rate in rates.items():
        print(f"{name:<22} {rate:8.1f} sentences/s (median of {args.rounds})")
    print(f"kvserve / sentence-transformers: {ratio:.2f}; cosine to sentence-transformers: min {cos.min():.6f}")
    Path(args.out).write_text(json.dumps({"args": vars(args), "sentences_per_s": rates, "ratio": round(ratio, 3),
                                          "min_cosine": float(cos.min()), "threads": torch.get_num_threads()},
                                         indent=1) + "\n")


if __name__ == "__main__":
    main()
