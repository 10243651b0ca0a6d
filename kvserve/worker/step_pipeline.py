"""A step launched under async scheduling, between its launch and its tokens reaching the host.

With `async_scheduling`, LLMEngine.step() schedules and launches step N + 1 before it waits for step N's tokens:
on a GPU the host's work for the next step (scheduling, inputs, sampling metadata) and for the last one (merging
its tokens, detokenizing, building outputs) runs while the device computes, instead of the device waiting for it.
A request decoding in step N holds a placeholder for its token (Request.num_placeholders); step N + 1 reads that
token on the device from step N's sampled tensor (ModelRunner.prepare_inputs, StepInputs.fixup)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.core.request import Request
from kvserve.core.scheduler import SchedulerOutput
from kvserve.transfer import HostCopy


@dataclass
class PendingStep:
    """A launched step: what it scheduled, its sampled tokens on the device and their copy to the host."""

    sched: SchedulerOutput
    reqs: list[Request]            # the requests that sample, in the sampled tensor's order
    index: dict[str, int]          # request id -> its row of `sampled`
    sampled: torch.Tensor | None   # [len(reqs)] long, on the device
    copy: HostCopy                 # the sampled tokens (and logprobs) on their way to the host
    pooled: dict                   # pooling requests' results (already on the host)
    parent_ids: list[str] | None = None   # the user requests of the step (the engine fails them if it fails)


def async_scheduling_choice(config, device: torch.device, tensor_parallel: bool) -> tuple[bool, str]:
    """(whether steps are launched behind the one in flight, why), from config.async_scheduling (None: auto)."""
    if config.async_scheduling is not None:
        return config.async_scheduling, "async_scheduling=" + str(config.async_scheduling)
    if config.speculative_config is not None:
        return False, "speculative decoding proposes drafts from the tokens just sampled"
    if tensor_parallel:
        return False, "tensor parallelism: each rank's step takes its input tokens from the driver"
    if device.type != "cuda":
        return False, "the CPU computes each step in the host's own thread: nothing to overlap"
    return True, "CUDA: the host's work overlaps the device's"
