"""Copies off the model's device: a fragment (a late result's values at its apply step, a seed),
an outer gradient's payload, and a whole state for a checkpoint, each straight into host memory
(never a second copy on the device).

    copy = copy_to_host(fragment, params)   # training thread: returns once the copy is queued
    values = copy.wait()                    # sync thread: blocks until the values are on the host
    copy = to_pinned(payload, flag)         # tensors already on the device, the same way
    state = to_host({"model": model.state_dict(), ...})   # every tensor copied to the host

On the CPU this is a plain copy (gather). On a GPU the fragment is gathered into one flat fp32
buffer on the device, on the training stream (ordered before the optimizer's next in-place
update), and that buffer is copied into pinned host memory with a non-blocking copy on a side
stream; an event recorded after the copy is what the sync thread waits on. The training stream
never waits for the device-to-host transfer.
"""
from __future__ import annotations

import copy
import functools
from collections.abc import Iterator, Mapping

import torch

from diloco.services.contract.fragments import Fragment, gather


class HostCopy:
    """Values in host memory, readable once `wait()` returns."""

    def __init__(self, values: torch.Tensor, copied: torch.cuda.Event | None = None,
                 rest: tuple[torch.Tensor, ...] = ()):
        self._values = values
        self._rest = rest  # more tensors copied with it
        self._copied = copied  # None: the values were copied synchronously
        # What crossed from the device to the host (0: nothing did).
        self.device_to_host_bytes = 0 if copied is None else sum(t.nbytes for t in (values, *rest))

    def wait(self) -> torch.Tensor:
        if self._copied is not None:
            self._copied.synchronize()
        return self._values

    @property
    def copies(self) -> tuple[torch.Tensor, ...]:
        """Every tensor copied, in order (the first is what wait() gives); call wait() first."""
        return (self._values, *self._rest)


@functools.cache
def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per GPU for device-to-host copies (made on first use)."""
    return torch.cuda.Stream(device)


def copy_to_host(fragment: Fragment, params: Mapping[str, torch.Tensor]) -> HostCopy:
    """Starts copying the fragment's current values to host memory (see the module's docstring)."""
    return to_pinned(gather(fragment, params))


def to_pinned(*tensors: torch.Tensor) -> HostCopy:
    """Starts copying tensors to host memory: of CUDA tensors into pinned memory on the side
    stream, after the work queued on the current stream, without waiting (a host tensor is
    taken as it is). `wait()` gives the first copy; `copies` all of them once waited for."""
    device = tensors[0].device
    if device.type != "cuda":
        return HostCopy(tensors[0], rest=tensors[1:])
    stream = _copy_stream(device)
    hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    stream.wait_stream(torch.cuda.current_stream(device))  # what made them comes first
    with torch.cuda.stream(stream):
        for host, t in zip(hosts, tensors):
            host.copy_(t, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(stream)
    for t in tensors:
        t.record_stream(stream)  # the allocator must not hand its memory out before the copy ran
    return HostCopy(hosts[0], copied, rest=tuple(hosts[1:]))


def to_host(state):
    """A deep copy of `state` (dicts, lists and tuples of tensors and plain values) whose tensors
    are all in host memory. Each tensor is copied to the host on its own, so a model that fills its
    GPU needs no room there for a copy of itself; CUDA tensors go into pinned memory with copies
    queued on the current stream one after another, and one wait per device ends them all."""
    tensors = list(_tensors(state))
    copies: dict[tuple | int, torch.Tensor] = {}  # a value held twice (tied weights) is copied once
    for t in tensors:
        if _value_of(t) not in copies:
            copies[_value_of(t)] = t.detach().to("cpu", non_blocking=t.is_cuda, copy=True)
    for device in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.current_stream(device).synchronize()
    # The containers as they were, each tensor replaced by its host copy.
    return copy.deepcopy(state, memo={id(t): copies[_value_of(t)] for t in tensors})


def _value_of(t: torch.Tensor) -> tuple | int:
    """The same key for tensors that view the same values (state_dict() gives tied weights as
    two tensors over one storage); a tensor without storage (meta) is its own."""
    address = t.untyped_storage().data_ptr()
    if not address:
        return id(t)
    return t.device, address, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype


def _tensors(value) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
