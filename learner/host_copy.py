"""A fragment's parameters copied to host memory, as flat fp32, for a sync to encode.

    copy = copy_to_host(fragment, params)   # training thread: returns once the copy is queued
    values = copy.wait()                    # sync thread: blocks until the values are on the host

On the CPU this is a plain copy (gather). On a GPU the fragment is gathered into one flat fp32
buffer on the device, on the training stream (ordered before the optimizer's next in-place
update), and that buffer is copied into pinned host memory with a non-blocking copy on a side
stream; an event recorded after the copy is what the sync thread waits on before encoding. The
training stream never waits for the device-to-host transfer.

Why host memory: anchors, outer gradients and error-feedback residuals are fp32 and live on
the host whatever the model's device and dtype (docs/gpus.md): they take no accelerator memory,
and the codecs and the wire work on host tensors.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping

import torch

from diloco.services.fragments import Fragment, gather


class HostCopy:
    """Flat fp32 values in host memory, readable once `wait()` returns."""

    def __init__(self, values: torch.Tensor, copied: torch.cuda.Event | None = None):
        self._values = values
        self._copied = copied  # None: the values were copied synchronously

    def wait(self) -> torch.Tensor:
        if self._copied is not None:
            self._copied.synchronize()
        return self._values


@functools.cache
def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per GPU for device-to-host copies (made on first use)."""
    return torch.cuda.Stream(device)


def copy_to_host(fragment: Fragment, params: Mapping[str, torch.Tensor]) -> HostCopy:
    """Starts copying the fragment's current values to host memory (see the module's docstring)."""
    flat = gather(fragment, params)
    if flat.device.type != "cuda":
        return HostCopy(flat)
    stream = _copy_stream(flat.device)
    host = torch.empty(flat.numel(), dtype=torch.float32, pin_memory=True)
    stream.wait_stream(torch.cuda.current_stream(flat.device))  # the gather comes first
    with torch.cuda.stream(stream):
        host.copy_(flat, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(stream)
    flat.record_stream(stream)  # the allocator must not hand flat's memory out before the copy ran
    return HostCopy(host, copied)
