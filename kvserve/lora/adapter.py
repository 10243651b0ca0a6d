"""Reading a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) into float32 A and B
matrices per linear of the base model, refusing anything kvserve would not run exactly as PEFT does."""
from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import dataclass, field

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from kvserve.errors import LoRAError
from kvserve.lora.request import LoRARequest
from kvserve.model.linear_roles import DECODER_LINEARS

# a PEFT target module (a checkpoint projection) -> (our linear, its shard), from the decoder's declared linears
TARGET_MODULES = {p.checkpoint: (r.name, i) for r in DECODER_LINEARS for i, p in enumerate(r.projections)}
_BLOCKS = {p.checkpoint: r.block for r in DECODER_LINEARS for p in r.projections}   # HF's module path
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(" + "|".join(sorted(set(_BLOCKS.values())))
                  + r")\.(\w+)\.lora_([AB])\.weight$")


@dataclass
class LoRAAdapter:
    """An adapter in memory: per (layer, linear, shard) the matrices A [r, K] and scale * B [N_shard, r]."""

    request: LoRARequest
    rank: int                    # the largest rank of its modules
    weights: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    target_modules: tuple[str, ...] = ()
    load_time_s: float = 0.0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def load_adapter(request: LoRARequest, shapes: dict[tuple[str, int], tuple[int, int]], num_layers: int,
                 max_rank: int) -> LoRAAdapter:
    """Read and check the adapter at request.lora_path. shapes: (linear, shard) -> (in features, out features) of
    the base model's projections; raises LoRAError saying what is wrong."""
    start = time.perf_counter()
    path = request.lora_path
    config = _read_config(path)
    tensors = _read_tensors(path)
    _check_config(config, path)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAError(_unsupported_key(key, path))
        layer, _, module, which = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if module not in TARGET_MODULES:
            raise LoRAError(f"the adapter at {path} adapts {module!r}, which kvserve does not: LoRA applies to "
                            f"{', '.join(TARGET_MODULES)}")
        if layer >= num_layers:
            raise LoRAError(f"the adapter at {path} adapts layer {layer}, but the base model has {num_layers} layers: "
                            f"it was trained for another model{_trained_on(config)}")
        pairs.setdefault((layer, module), {})[which] = tensor
    if not pairs:
        raise LoRAError(f"the adapter at {path} holds no LoRA weights")
    adapter = LoRAAdapter(request, 0, target_modules=tuple(sorted({m for _, m in pairs})))
    for (layer, module), ab in sorted(pairs.items()):
        linear, shard = TARGET_MODULES[module]
        if (linear, shard) not in shapes:
            raise LoRAError(f"the adapter at {path} adapts {module}, which this base model's layers do not all have "
                            f"(mixture-of-experts MLPs take no adapter): LoRA applies here to "
                            f"{', '.join(sorted(m for m, key in TARGET_MODULES.items() if key in shapes))}")
        a, b = _pair(ab, layer, module, path)
        rank = a.shape[0]
        if rank > max_rank:
            raise LoRAError(f"the adapter at {path} has rank {rank}, more than max_lora_rank={max_rank}: start the "
                            "engine with a larger max_lora_rank (--max-lora-rank)")
        in_features, out_features = shapes[(linear, shard)]
        if a.shape[1] != in_features or b.shape[0] != out_features:
            raise LoRAError(f"the adapter at {path} does not fit this base model: layer {layer} {module} takes "
                            f"{a.shape[1]} inputs to {b.shape[0]} outputs, the model's {in_features} to "
                            f"{out_features}{_trained_on(config)}")
        scale = _alpha(config, f"model.layers.{layer}.{_BLOCKS[module]}.{module}") / (
            math.sqrt(rank) if config.get("use_rslora") else rank)
        adapter.weights[(layer, linear, shard)] = (a.float().contiguous(), (b.float() * scale).contiguous())
        adapter.rank = max(adapter.rank, rank)
    adapter.load_time_s = time.perf_counter() - start
    return adapter


def _read_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise LoRAError(f"LoRA adapter path {path!r} is not a directory (a PEFT adapter directory holds "
                        "adapter_config.json and adapter_model.safetensors)")
    cfg_path = os.path.join(path, "adapter_config.json")
    try:
        with open(cfg_path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise LoRAError(f"{path} is not a PEFT adapter: it has no adapter_config.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAError(f"cannot read {cfg_path}: {e}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{cfg_path} is not a JSON object")
    return config


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    if os.path.exists(st):
        try:
            return load_file(st)
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise LoRAError(f"cannot read {st}: it is not a valid safetensors file ({e})") from None
    binary = os.path.join(path, "adapter_model.bin")
    if os.path.exists(binary):
        try:
            state = torch.load(binary, map_location="cpu", weights_only=True)
        except Exception as e:   # torch.load raises many types for a corrupt pickle
            raise LoRAError(f"cannot read {binary}: {type(e).__name__}: {e}") from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise LoRAError(f"{binary} does not hold a dictionary of tensors")
        return state
    raise LoRAError(f"the adapter at {path} has no weights: adapter_model.safetensors (or adapter_model.bin) is "
                    "missing")


def _check_config(config: dict, path: str) -> None:
    """Refuse what PEFT computes differently from y = x W + scale (x A) B."""
    def refuse(why: str):
        raise LoRAError(f"the adapter at {path} is not supported: {why}")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        refuse(f"it is a {peft_type} adapter; kvserve serves LoRA adapters")
    if config.get("use_dora"):
        refuse("it is a DoRA adapter (use_dora), whose weight-decomposed update kvserve does not compute")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        refuse("it trains biases (bias / lora_bias); kvserve applies only the A and B matrices")
    if config.get("modules_to_save"):
        refuse(f"it saves whole modules ({', '.join(map(str, config['modules_to_save']))}), which would replace "
               "the base model's")
    if config.get("fan_in_fan_out"):
        refuse("fan_in_fan_out is for Conv1D (GPT-2-style) weights")
    if config.get("layer_replication"):
        refuse("layer_replication changes the base model's layers")
    for name in ("r", "lora_alpha"):
        value = config.get(name)
        if value is not None and not _is_positive(value):
            refuse(f"{name} must be a positive number, got {value!r}")
    for name in ("alpha_pattern", "rank_pattern"):
        patterns = config.get(name) or {}
        if not isinstance(patterns, dict):
            refuse(f"{name} must map module name patterns to numbers, got {patterns!r}")
        for pattern, value in patterns.items():
            try:
                re.compile(pattern)
            except re.error as e:
                refuse(f"{name} has the invalid pattern {pattern!r}: {e}")
            if not _is_positive(value):
                refuse(f"{name}[{pattern!r}] must be a positive number, got {value!r}")


def _is_positive(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _unsupported_key(key: str, path: str) -> str:
    if "lora_magnitude_vector" in key:
        return f"the adapter at {path} is a DoRA adapter ({key}), which kvserve does not compute"
    if ".experts." in key or ".shared_expert" in key or ".block_sparse_moe." in key:
        return (f"the adapter at {path} adapts a mixture-of-experts MLP ({key}), which kvserve does not: LoRA "
                f"applies to the attention projections of MoE models")
    if "lora_embedding" in key or "embed" in key or "lm_head" in key:
        return (f"the adapter at {path} adapts the embeddings or the output head ({key}); kvserve applies LoRA to "
                f"{', '.join(TARGET_MODULES)}")
    return f"the adapter at {path} holds a tensor kvserve does not know: {key!r}"


def _pair(ab: dict[str, torch.Tensor], layer: int, module: str, path: str) -> tuple[torch.Tensor, torch.Tensor]:
    if set(ab) != {"A", "B"}:
        missing = "lora_B" if "A" in ab else "lora_A"
        raise LoRAError(f"the adapter at {path} is corrupt: layer {layer} {module} has no {missing} weight")
    a, b = ab["A"], ab["B"]
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] == 0:
        raise LoRAError(f"the adapter at {path} is corrupt: layer {layer} {module} has lora_A {tuple(a.shape)} and "
                        f"lora_B {tuple(b.shape)} (expected [r, in] and [out, r])")
    if not (a.is_floating_point() and b.is_floating_point()):
        raise LoRAError(f"the adapter at {path} is corrupt: layer {layer} {module} is not floating point")
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise LoRAError(f"the adapter at {path} is corrupt: layer {layer} {module} holds NaN or infinite values")
    return a, b


def _alpha(config: dict, module_name: str) -> float:
    """lora_alpha, or the alpha_pattern entry matching the module (PEFT's rule: the pattern matches a suffix of its
    name at a dot)."""
    for pattern, alpha in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module_name):
            return float(alpha)
    alpha = config.get("lora_alpha")
    return float(alpha if alpha is not None else 8)


def _trained_on(config: dict) -> str:
    base = config.get("base_model_name_or_path")
    return f" (it was trained on {base})" if base else ""
