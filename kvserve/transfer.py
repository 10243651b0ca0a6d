"""Host <-> device copies that do not stall the host on a GPU.

A plain copy from pageable host memory to a CUDA device waits for everything queued on the stream before it
returns (torch synchronizes the stream after it), and so does reading a device tensor on the host. With async
scheduling the next step is launched while the last one still runs on the device: one such copy in the launch
would make the host wait for the step before it, and the overlap would be gone. Host data therefore goes to the
device through pinned memory without a wait, and results come back the same way, with an event to wait on only
when they are read. On the CPU both are the tensors themselves (no copy)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


def to_device(data, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`data` (a list, a NumPy array or a host tensor) as a tensor of `dtype` on `device`, without waiting."""
    t = torch.as_tensor(data, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    # the caching host allocator keeps the pinned block until the copy from it is done
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class HostCopy:
    """Device tensors on their way to the host: `wait()` returns them there once the copies are done."""

    tensors: list[torch.Tensor]
    event: object = None   # torch.cuda.Event recorded after the copies; None on the CPU

    def wait(self) -> list[torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
        return self.tensors


def to_host(tensors: list[torch.Tensor]) -> HostCopy:
    """Start copying `tensors` to the host (pinned memory, no wait); on the CPU they are returned as they are."""
    if not tensors or tensors[0].device.type != "cuda":
        return HostCopy(list(tensors))
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors]
    event = torch.cuda.Event()
    event.record()
    return HostCopy(host, event)
