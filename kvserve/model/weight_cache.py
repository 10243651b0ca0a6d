"""A disk cache of a GGUF file's dequantized weights (safetensors, one file per serving dtype).

Opening a GGUF parses its whole metadata (the tokenizer's vocabulary and merges) and dequantizes every
tensor: ~3 s for SmolLM2-135M. The cache holds the HF-named weights already in the serving dtype, with
the ModelConfig in the safetensors metadata, so a later start reads one file (~0.2 s).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch

from kvserve.model.model_config import ModelConfig

logger = logging.getLogger("kvserve")

MAX_CACHED_GGUF_BYTES = 2 << 30   # bigger files would hold all dequantized weights in memory to write them
# part of every cache key: bump it whenever ModelConfig's fields or gguf_loader's conversion (names, dequantization,
# q/k un-permute) change, or caches written by the old code would keep being served
FORMAT_VERSION = 2
_CONFIG_KEY = "kvserve_model_config"


def cache_root() -> Path:
    return Path.home() / ".cache" / "kvserve" / "weights"


def cache_path(gguf_path: str, dtype: torch.dtype) -> Path | None:
    """Where this file's weights in `dtype` are cached; None when the file is too big to cache."""
    st = os.stat(gguf_path)
    if st.st_size > MAX_CACHED_GGUF_BYTES:
        return None
    ident = f"{os.path.abspath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|{dtype}|v{FORMAT_VERSION}"
    return cache_root() / f"{hashlib.sha256(ident.encode()).hexdigest()[:24]}.safetensors"


def read(path: Path) -> tuple[ModelConfig, Iterable[tuple[str, torch.Tensor]]] | None:
    """The cached config and (name, tensor) pairs, read one at a time as they are iterated (the file's pages leave
    the resident set as the load goes: loader.iter_safetensors_file), or None when there is no usable entry (a
    damaged one is removed)."""
    if not path.exists():
        return None
    from safetensors import safe_open
    from kvserve.model.loader import iter_safetensors_file
    try:
        with safe_open(str(path), "pt") as f:   # a damaged header fails here, before the load begins
            fields = json.loads(f.metadata()[_CONFIG_KEY])
        return ModelConfig(**fields), iter_safetensors_file(path)
    except Exception as e:  # never fatal: the GGUF is still there
        logger.warning("kvserve: ignoring a damaged weight cache %s (%s)", path, e)
        path.unlink(missing_ok=True)
        return None


def write(path: Path, cfg: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Save atomically (temp file + rename); a read-only home only costs the next start its ~3 s."""
    from safetensors.torch import save_file
    fields = dataclasses.asdict(cfg)
    if fields.get("torch_dtype") is not None:
        return   # only plain GGUF configs round-trip through JSON
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".safetensors")
        os.close(fd)
    except OSError:
        return
    try:
        save_file({name: t.contiguous() for name, t in weights}, tmp, metadata={_CONFIG_KEY: json.dumps(fields)})
        os.replace(tmp, path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)
