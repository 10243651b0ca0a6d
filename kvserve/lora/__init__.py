"""Multi-LoRA serving: many PEFT adapters over one base model, requests for different adapters batched together."""
from kvserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
