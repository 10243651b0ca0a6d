"""`kvserve bench perplexity MODEL --text FILE`: perplexity over a text, computed as llama.cpp's llama-perplexity
does, so the figures compare with its: the text tokenized with BOS first where the tokenizer adds one, split into
chunks of --ctx-size tokens (the first token of each replaced by BOS there), each chunk run alone, and only the
predictions of its second half scored (positions ctx/2 .. ctx-2 predicting the next token). As llama-perplexity,
it needs at least two chunks of text. It runs through the engine (prompt logprobs), so
it measures what serving computes: quantized kernels, the KV cache dtype, chunked prefill.
"""
from __future__ import annotations

import argparse
import math
import time

from kvserve.errors import InvalidRequestError


def chunk_tokens(token_ids: list[int], n_ctx: int, bos_id: int | None) -> list[list[int]]:
    """Whole chunks of n_ctx tokens of the text's tokens (BOS first if given: the tokenization llama-perplexity
    scores), the remainder dropped; each chunk's first token then replaced by BOS, as llama-perplexity does."""
    if bos_id is not None:
        token_ids = [bos_id] + token_ids
    chunks = [token_ids[i:i + n_ctx] for i in range(0, len(token_ids) - n_ctx + 1, n_ctx)]
    if bos_id is not None:
        chunks = [[bos_id] + c[1:] for c in chunks]
    return chunks


def chunk_nll(prompt_logprobs, chunk: list[int]) -> tuple[float, int]:
    """(summed negative log-likelihood, count) of the chunk's scored positions: tokens n_ctx/2 + 1 .. n_ctx - 1."""
    first = len(chunk) // 2
    nll = 0.0
    for pos in range(first + 1, len(chunk)):
        nll -= prompt_logprobs[pos][chunk[pos]].logprob
    return nll, len(chunk) - first - 1


def perplexity(llm, text: str, n_ctx: int = 512, batch: int = 4) -> dict:
    """Perplexity of `llm` over `text` (see the module docstring); the figures as a dict."""
    from kvserve import SamplingParams
    if n_ctx < 4:
        raise InvalidRequestError(f"ctx size must be at least 4, got {n_ctx}", "ctx_size")
    tokenizer = llm.get_tokenizer()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None and with_special[:1] == [
        tokenizer.bos_token_id] else None
    chunks = chunk_tokens(ids, n_ctx, bos)
    if len(chunks) < 2:
        raise InvalidRequestError(f"the text has {len(ids)} tokens: perplexity needs at least 2 * ctx size "
                                  f"({2 * n_ctx}), as llama-perplexity does", "text")
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    nll, count = 0.0, 0
    start = time.perf_counter()
    for i in range(0, len(chunks), batch):   # a few chunks per call: each call's prompt logprobs stay small
        group = chunks[i:i + batch]
        outs = llm.generate([{"prompt_token_ids": c} for c in group], params, use_tqdm=False)
        for out, chunk in zip(outs, group):
            n, c = chunk_nll(out.prompt_logprobs, chunk)
            nll, count = nll + n, count + c
    mean = nll / count
    return {"ppl": math.exp(mean), "mean_nll": mean, "num_chunks": len(chunks), "num_scored_tokens": count,
            "num_text_tokens": len(ids), "n_ctx": n_ctx, "bos": bos, "seconds": time.perf_counter() - start}


def add_perplexity_arguments(p: argparse.ArgumentParser, add_engine_arguments) -> None:
    """Flags of `kvserve bench perplexity`."""
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                   help="HF directory or .gguf file (default: the bundled SmolLM2-135M)")
    add_engine_arguments(p)
    p.add_argument("--text", "-f", required=True, help="the text file to score (e.g. tests/data/gpl-3.0.txt)")
    p.add_argument("--ctx-size", "-c", type=int, default=512, help="tokens per chunk, as llama-perplexity's -c")
    p.set_defaults(bench_func=run_perplexity)


def run_perplexity(args) -> dict:
    from kvserve.entrypoints.bench import _make_llm, _write_json
    if args.model_path is not None:
        args.model = args.model_path
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    llm, load_s = _make_llm(args)
    result = perplexity(llm, text, args.ctx_size)
    result.update(model=args.model or "bundled SmolLM2-135M-Instruct", text=args.text, load_s=load_s,
                  quantization=getattr(args, "quantization", None) or "auto", weights=llm.llm_engine.weights_summary)
    print(f"perplexity {result['ppl']:.4f} over {result['num_chunks']} chunks of {args.ctx_size} tokens "
          f"({result['num_scored_tokens']} tokens scored) in {result['seconds']:.1f} s; weights: {result['weights']}")
    _write_json(args, result)
    return result
