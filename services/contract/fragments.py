"""The fragment plan: which named tensors travel together, when, and to which shard.

A model's parameters are partitioned into P fragments. Fragment p is synchronised when
`step % H == t_p`, with the offsets t_p spread evenly over the H steps, so some fragment is
usually in flight and peak bandwidth is about 1/P of syncing the whole model at once.
Fragments are assigned to S syncer shards, balanced by bytes.

The plan is a pure function of (ordered parameter names and shapes, P, H, S, method): every
learner and every shard computes it on its own, and the digest proves they agree. Nothing
here depends on dict/set iteration order, hash seeds or the process.

Two ways to split:
- "balanced" (default, Decoupled DiLoCo): greedy bin-packing of whole tensors, largest first,
  onto the lightest fragment. Fragments come out nearly equal in size, which is what keeps
  peak bandwidth low.
- "strided" (Streaming DiLoCo): fragment p holds the blocks whose layer index is p mod P;
  tensors outside the blocks (embeddings, final norm, head) fill the lightest fragments.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

METHODS = ("balanced", "strided")
_FP32_BYTES = 4
# Bump if the canonical description changes: old and new processes must not agree by accident.
_DIGEST_FORMAT = "diloco.fragment-plan/1"


@dataclass(frozen=True)
class TensorSlot:
    """One named tensor inside a fragment's flat fp32 vector."""

    name: str
    shape: tuple[int, ...]
    numel: int
    offset: int  # in elements, within the fragment's flat vector


@dataclass(frozen=True)
class Fragment:
    id: int
    tensors: tuple[TensorSlot, ...]  # in the model's own order: the order of the flat vector
    numel: int
    offset_step: int  # t_p: synced when step % H == offset_step
    shard: int

    @property
    def nbytes(self) -> int:
        return self.numel * _FP32_BYTES


@dataclass(frozen=True)
class FragmentPlan:
    fragments: tuple[Fragment, ...]  # fragments[i].id == i
    num_shards: int
    sync_interval: int  # H
    method: str
    digest: str  # sha256 hex of the canonical description; equal plans have equal digests

    def for_shard(self, shard: int) -> tuple[Fragment, ...]:
        if not 0 <= shard < self.num_shards:
            raise ValueError(f"shard {shard} out of range: the plan has {self.num_shards} shard(s)")
        return tuple(f for f in self.fragments if f.shard == shard)

    def fragment_of(self, name: str) -> Fragment:
        try:
            return self._fragment_by_name[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in the fragment plan") from None

    def due_at(self, step: int) -> tuple[Fragment, ...]:
        phase = step % self.sync_interval
        return tuple(f for f in self.fragments if f.offset_step == phase)

    @property
    def total_numel(self) -> int:
        return sum(f.numel for f in self.fragments)

    @cached_property
    def _fragment_by_name(self) -> dict[str, Fragment]:
        return {slot.name: f for f in self.fragments for slot in f.tensors}


def plan_fragments(
    tensors: Sequence[tuple[str, Sequence[int]]],
    num_fragments: int,
    sync_interval: int,
    num_shards: int = 1,
    method: str = "balanced",
) -> FragmentPlan:
    """Partition the named tensors (in the model's order) into `num_fragments` fragments,
    spread their sync offsets over `sync_interval` steps and assign them to `num_shards`
    shards. Raises ValueError on input that cannot make a plan where every fragment and
    every shard has something to sync."""
    names, shapes = _validated(tensors, num_fragments, sync_interval, num_shards, method)
    numels = [math.prod(shape) for shape in shapes]

    if method == "balanced":
        fragment_of_tensor = _pack_largest_first(numels, names, [0] * num_fragments)
    else:
        fragment_of_tensor = _strided(names, numels, num_fragments)

    # Slots follow input order, so gather/scatter walk the model in its own order.
    members: list[list[int]] = [[] for _ in range(num_fragments)]
    for i, p in enumerate(fragment_of_tensor):
        members[p].append(i)
    fragment_numels = [sum(numels[i] for i in m) for m in members]
    shard_of_fragment = _pack_largest_first(
        [n * _FP32_BYTES for n in fragment_numels], list(range(num_fragments)), [0] * num_shards
    )

    fragments = []
    for p, member in enumerate(members):
        slots, offset = [], 0
        for i in member:
            slots.append(TensorSlot(names[i], shapes[i], numels[i], offset))
            offset += numels[i]
        fragments.append(
            Fragment(
                id=p,
                tensors=tuple(slots),
                numel=offset,
                offset_step=(p * sync_interval) // num_fragments,
                shard=shard_of_fragment[p],
            )
        )
    fragments = tuple(fragments)
    return FragmentPlan(
        fragments=fragments,
        num_shards=num_shards,
        sync_interval=sync_interval,
        method=method,
        digest=_digest(fragments, num_shards, sync_interval, method),
    )


def device_of(fragment: Fragment, params: Mapping[str, torch.Tensor]) -> torch.device:
    """Where the fragment's parameters live (its first tensor's device)."""
    return params[fragment.tensors[0].name].device


def gather(fragment: Fragment, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """A new flat fp32 vector on the parameters' device: the fragment's tensors, whatever their
    dtype, concatenated in slot order."""
    tensors = [_checked_param(slot, params) for slot in fragment.tensors]
    flat = torch.empty(fragment.numel, dtype=torch.float32, device=device_of(fragment, params))
    with torch.no_grad():  # the flat copy must not join the model's autograd graph
        for slot, tensor in zip(fragment.tensors, tensors):
            flat[slot.offset : slot.offset + slot.numel].copy_(tensor.reshape(-1))
    return flat


def scatter(fragment: Fragment, flat: torch.Tensor, params: Mapping[str, torch.Tensor]) -> None:
    """Copy the slices of `flat` back into the fragment's parameters, in place (each keeps its
    device and dtype)."""
    with torch.no_grad():
        for param, piece in pieces(fragment, flat, params):
            param.copy_(piece, non_blocking=piece.is_pinned())


def to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`values` on `device`: from pinned host memory without waiting (torch keeps that memory
    until the copy has run), from other memory as a plain copy."""
    return values.to(device, non_blocking=values.is_pinned())


def pieces(fragment: Fragment, flat: torch.Tensor,
           params: Mapping[str, torch.Tensor]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each of the fragment's parameters with its slice of `flat` (a fragment's flat vector),
    shaped like it; where `flat` lives and its dtype stay as they are."""
    if flat.dim() != 1 or flat.numel() != fragment.numel:
        raise ValueError(
            f"fragment {fragment.id} expects a 1-D vector of {fragment.numel} elements, "
            f"got shape {tuple(flat.shape)}"
        )
    for slot in fragment.tensors:
        yield _checked_param(slot, params), flat[slot.offset : slot.offset + slot.numel].reshape(slot.shape)


def assemble(manifest: Sequence[tuple[str, Sequence[int]]],
             values: Iterable[tuple[Fragment, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The manifest's parameters by name, fp32, cut from each fragment's flat value."""
    params = {name: torch.empty(tuple(shape), dtype=torch.float32) for name, shape in manifest}
    for fragment, flat in values:
        scatter(fragment, flat, params)
    return params


def _validated(
    tensors: Sequence[tuple[str, Sequence[int]]],
    num_fragments: int,
    sync_interval: int,
    num_shards: int,
    method: str,
) -> tuple[list[str], list[tuple[int, ...]]]:
    if method not in METHODS:
        raise ValueError(
            f"unknown fragmentation method {method!r}; valid methods: {', '.join(METHODS)}"
        )
    if num_fragments < 1:
        raise ValueError(f"num_fragments must be >= 1, got {num_fragments}")
    if sync_interval < 1:
        raise ValueError(f"sync_interval must be >= 1, got {sync_interval}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")

    names, shapes, seen = [], [], set()
    for name, shape in tensors:
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
        if name in seen:
            raise ValueError(f"duplicate tensor name {name!r}")
        seen.add(name)
        shape = tuple(operator.index(d) for d in shape)  # refuses 2.5, accepts torch.Size
        if any(d < 1 for d in shape):  # a zero-size tensor has nothing to sync
            raise ValueError(f"tensor {name!r} has a non-positive dimension in shape {shape}")
        names.append(name)
        shapes.append(shape)

    if num_fragments > len(names):
        raise ValueError(
            f"num_fragments={num_fragments} exceeds the number of tensors ({len(names)}): "
            "a fragment would be empty and could never be synced"
        )
    if num_shards > num_fragments:
        raise ValueError(
            f"num_shards={num_shards} exceeds num_fragments={num_fragments}: "
            "a shard would own no fragment"
        )
    return names, shapes


def _strided(names: list[str], numels: list[int], num_fragments: int) -> list[int]:
    layer_of = [_layer_index(name) for name in names]
    layers = sorted({layer for layer in layer_of if layer is not None})
    if len(layers) < num_fragments:
        raise ValueError(
            f"strided fragmentation needs at least num_fragments={num_fragments} layers, "
            f"found {len(layers)} (the layer index is the first integer component of a tensor name)"
        )
    empty = sorted(set(range(num_fragments)) - {layer % num_fragments for layer in layers})
    if empty:
        raise ValueError(
            f"strided fragmentation: no layer index is congruent to {empty[0]} "
            f"mod {num_fragments}, so fragment {empty[0]} would hold no layer "
            f"(layer indices: {layers})"
        )

    fragment_of_tensor = [0] * len(names)
    loads = [0] * num_fragments
    rest = []  # tensors outside the blocks: positions into names
    for i, layer in enumerate(layer_of):
        if layer is None:
            rest.append(i)
        else:
            fragment_of_tensor[i] = layer % num_fragments
            loads[layer % num_fragments] += numels[i]
    packed = _pack_largest_first([numels[i] for i in rest], [names[i] for i in rest], loads)
    for i, p in zip(rest, packed):
        fragment_of_tensor[i] = p
    return fragment_of_tensor


def _layer_index(name: str) -> int | None:
    """`blocks.3.attn.c_attn.weight` -> 3; `transformer.wte.weight` -> None."""
    for part in name.split("."):
        if part.isascii() and part.isdigit():
            return int(part)
    return None


def _pack_largest_first(
    sizes: Sequence[int], tie_breakers: Sequence[str | int], loads: list[int]
) -> list[int]:
    """Greedy bin-packing (longest processing time first): each item, largest first (ties by
    `tie_breakers`), goes to the currently lightest bin (ties by lowest bin index), starting
    from `loads`. The fullest bin then exceeds the emptiest by at most the largest item.
    Returns the bin of each item."""
    heap = [(load, b) for b, load in enumerate(loads)]
    heapq.heapify(heap)
    bin_of = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], tie_breakers[i])):
        load, b = heapq.heappop(heap)
        bin_of[i] = b
        heapq.heappush(heap, (load + sizes[i], b))
    return bin_of


def _digest(
    fragments: tuple[Fragment, ...], num_shards: int, sync_interval: int, method: str
) -> str:
    # Sorted keys, fixed separators and ASCII escapes: the same plan gives the same bytes in
    # every process and Python version.
    description = {
        "format": _DIGEST_FORMAT,
        "method": method,
        "sync_interval": sync_interval,
        "num_shards": num_shards,
        "fragments": [
            {
                "id": f.id,
                "offset_step": f.offset_step,
                "shard": f.shard,
                "tensors": [[slot.name, list(slot.shape)] for slot in f.tensors],
            }
            for f in fragments
        ],
    }
    canonical = json.dumps(description, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def _checked_param(slot: TensorSlot, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
    param = params[slot.name]
    if tuple(param.shape) != slot.shape:
        raise ValueError(
            f"tensor {slot.name!r} has shape {tuple(param.shape)}, the plan expects {slot.shape}"
        )
    return param


def plan_for_config(cfg, manifest: Sequence[tuple[str, Sequence[int]]]) -> FragmentPlan:
    """The plan a run's config gives for a model manifest: what shards and learners compute.
    A model larger than limits.max_parameters is refused: shards allocate their share of it."""
    plan = plan_fragments(manifest, cfg.sync.fragments, cfg.sync.interval_steps,
                          len(cfg.shards), cfg.sync.fragmentation)
    if plan.total_numel > cfg.limits.max_parameters:
        raise ValueError(f"the manifest declares {plan.total_numel} parameters, more than "
                         f"limits.max_parameters={cfg.limits.max_parameters}")
    return plan
