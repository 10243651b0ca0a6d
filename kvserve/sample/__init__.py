"""Batched sampling: metadata built once per step, then penalties, truncation and the draw."""
from kvserve.sample.logprobs import LogprobsTensors, compute_prompt_logprobs
from kvserve.sample.metadata import SamplingMetadata, SamplingRow
from kvserve.sample.sampler import Sampler, SamplerOutput

__all__ = ["LogprobsTensors", "Sampler", "SamplerOutput", "SamplingMetadata", "SamplingRow",
           "compute_prompt_logprobs"]
