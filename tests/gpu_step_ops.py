"""The kernels one decode step's forward would launch on a GPU, counted on the CPU: a process that takes the GPU's
ops there (no C++ kernels: torch's matmuls; the Triton layer kernels of kvserve/model/triton_ops.py and the Triton
attention backend, under Triton's interpreter) runs a decode step of tiny random bf16 Llamas and Gemma 3s of 2 and 3
layers and counts what the forward dispatches: torch ops that launch work (not views or allocations) and Triton
launches.

    KVSERVE_KERNELS=none TRITON_INTERPRET=1 python tests/gpu_step_ops.py DIR

prints JSON {family: {layers: {"torch": {op: count}, "triton": {kernel: count}}}}. tests/test_gpu_step_ops.py runs it in
a process of its own (the kernel variant and Triton's interpreter are read at import)."""
from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_utils import GEMMA3, save_tiny_model  # noqa: E402

# ops that launch no work on a GPU: views, metadata, allocations
NO_KERNEL = {"view", "_unsafe_view", "reshape", "expand", "slice", "select", "t", "transpose", "unsqueeze", "squeeze",
             "as_strided", "permute", "detach", "alias", "split", "split_with_sizes", "chunk", "unbind", "narrow",
             "lift_fresh", "empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "sym_size",
             "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "_reshape_alias"}


class Counter(TorchDispatchMode):
    """The torch ops dispatched outside Triton launches (the interpreter's own copies are not the GPU's)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and func.__name__.split(".")[0] not in NO_KERNEL:
            self.ops[func.__name__] += 1
        return func(*args, **(kwargs or {}))


def count_triton(counter: Counter, launches: collections.Counter) -> None:
    """Every Triton kernel of the GPU path counts its launches (and pauses the torch count while it runs)."""
    from kvserve.attention.triton import kernels as attention_kernels
    from kvserve.model import triton_ops

    class Counted:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launch = self.kernel[grid]

            def run(*args, **kwargs):
                launches[self.name] += 1
                counter.paused += 1
                try:
                    return launch(*args, **kwargs)
                finally:
                    counter.paused -= 1
            return run

    for module in (triton_ops, attention_kernels):
        for name in dir(module):
            if name.endswith("_kernel"):
                setattr(module, name, Counted(name, getattr(module, name)))


GPU_OPS = {"on": False}   # the prompts' prefill runs torch's layer ops: the interpreter's per-row programs are slow


def gpu_ops_on_cpu() -> None:
    """layers.py's GPU dispatch for CPU tensors: the Triton layer kernels wherever a CUDA tensor would take them
    (while GPU_OPS is on)."""
    from kvserve.model import layers, triton_ops

    def gpu_ops(x: torch.Tensor):
        ok = x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2 and x.stride(1) == 1
        return triton_ops if ok and GPU_OPS["on"] else None
    layers._gpu_ops = gpu_ops


def decode_step_ops(path: Path, counter: Counter, launches: collections.Counter) -> dict:
    from kvserve import LLM, SamplingParams
    from kvserve.model import default_model_path
    from kvserve.sampling_params import RequestOutputKind
    llm = LLM(model=str(path), tokenizer=default_model_path(), dtype="bfloat16", device="cpu",
              attention_backend="triton", num_kv_blocks=32, async_scheduling=False)
    engine = llm.llm_engine
    for i in range(4):
        engine.add_request(f"r{i}", {"prompt_token_ids": list(range(5, 12 + i))},
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                          output_kind=RequestOutputKind.DELTA))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or \
            engine.scheduler.waiting:
        engine.step()
    cls = type(engine.model)   # an InferenceModule: its call is the class's forward
    call = cls.__call__

    def counted(self, *args, **kwargs):
        counter.ops.clear()
        launches.clear()
        with counter:
            return call(self, *args, **kwargs)
    cls.__call__ = counted
    GPU_OPS["on"] = True
    try:
        engine.step()
    finally:
        cls.__call__ = call
        GPU_OPS["on"] = False
    engine.shutdown()
    return {"torch": dict(counter.ops), "triton": dict(launches)}


def main(root: Path) -> None:
    from triton_interpreter import lighten
    lighten()
    counter, launches = Counter(), collections.Counter()
    gpu_ops_on_cpu()
    count_triton(counter, launches)
    shape = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    out: dict = {}
    for family in ("llama", "gemma3"):   # Gemma 3: four norms a layer, q/k norms, GeGLU, local and global layers
        for n in (2, 3):
            extra = dict(GEMMA3, layer_types=GEMMA3["layer_types"][:n]) if family == "gemma3" else {}
            path = root / f"{family}{n}"
            save_tiny_model(family, path, **{**extra, **shape, "num_hidden_layers": n})
            out.setdefault(family, {})[n] = decode_step_ops(path, counter, launches)
    print(json.dumps(out))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
