"""LoRARequest: which adapter a request runs with (vLLM's names and fields)."""
from __future__ import annotations

import os
from dataclasses import dataclass

from kvserve.errors import LoRAError


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter by name, unique integer id (> 0) and PEFT directory. The id is its identity: the prefix cache
    and the engine's adapter slots key on it, so one id must always mean the same adapter."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise LoRAError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise LoRAError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if isinstance(self.lora_path, os.PathLike):
            object.__setattr__(self, "lora_path", os.fspath(self.lora_path))
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise LoRAError(f"lora_path must be a PEFT adapter directory, got {self.lora_path!r}")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id
