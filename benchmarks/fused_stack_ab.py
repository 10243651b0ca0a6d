"""The fused C++ layer stack against the layer modules on one model, alternating in one process: single-stream
time to the first token and per output token (256 prompt tokens, 128 out).

    python benchmarks/fused_stack_ab.py [MODEL] [DTYPE] [ROUNDS]    # MODEL "" = the bundled one
"""
import sys, time
import torch
from kvserve import LLM, SamplingParams

path = sys.argv[1]
dtype = sys.argv[2] if len(sys.argv) > 2 else "bfloat16"
llm = LLM(model=path or None, dtype=dtype, max_model_len=1024, enable_prefix_caching=False)
stack = llm.llm_engine.model.model
print(stack.fused_status())
g = torch.Generator().manual_seed(0)
prompt = {"prompt_token_ids": torch.randint(100, 20000, (256,), generator=g).tolist()}
out_len = 128
def run():
    t0 = time.perf_counter()
    p1 = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    llm.generate([prompt], p1, use_tqdm=False)
    t1 = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True), use_tqdm=False)
    t2 = time.perf_counter()
    ttft = t1 - t0
    return ttft * 1e3, ((t2 - t1) - ttft) / (out_len - 1) * 1e3
run()
res = {True: [], False: []}
for i in range(int(sys.argv[3]) if len(sys.argv) > 3 else 3):
    for flag in (True, False):
        stack.use_fused_layers = flag
        res[flag].append(run())
for flag in (True, False):
    print("fused" if flag else "modules", " ".join(f"TTFT {a:.0f} ms TPOT {b:.2f} ms" for a, b in res[flag]))
