"""The fragment plan: a partition of the model that every process computes identically."""
import collections
import hashlib
import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from diloco.services.contract.fragments import gather, plan_fragments, scatter

ROOT = pathlib.Path(__file__).resolve().parent.parent
property_test = settings(deadline=None)  # the first torch call in a process is slow

shapes = st.lists(st.integers(1, 6), max_size=3).map(tuple)  # () is a scalar: numel 1


@st.composite
def layered_models(draw):
    """Names like a real model's: blocks numbered 0..L-1 plus a few tensors outside them,
    in any order (the plan must not assume embeddings come first)."""
    prefix = draw(st.sampled_from(["blocks", "transformer.h", "model.layers"]))
    leaves = ["attn.weight", "attn.bias", "mlp.weight", "ln.weight"]
    tensors = [
        (f"{prefix}.{layer}.{leaf}", draw(shapes))
        for layer in range(draw(st.integers(1, 8)))
        for leaf in leaves[: draw(st.integers(1, len(leaves)))]
    ]
    candidates = ["wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias", "lm_head.weight"]
    outside = draw(st.lists(st.sampled_from(candidates), unique=True))
    tensors += [(name, draw(shapes)) for name in outside]
    return draw(st.permutations(tensors))


# Any names at all, including unicode and names that look alike.
arbitrary_models = st.lists(st.tuples(st.text(min_size=1, max_size=8), shapes),
                            min_size=1, max_size=24, unique_by=lambda t: t[0])


def layer_of(name):
    match = re.search(r"(?:^|\.)(\d+)(?:\.|$)", name, re.ASCII)
    return int(match.group(1)) if match else None


@st.composite
def plans(draw, method=None):
    """(tensors, P, H, S, plan) with P, H, S anywhere in their valid ranges."""
    method = method or draw(st.sampled_from(["balanced", "strided"]))
    if method == "strided":
        tensors = draw(layered_models())
        max_fragments = len({layer_of(n) for n, _ in tensors} - {None})
    else:
        tensors = draw(st.one_of(layered_models(), arbitrary_models))
        max_fragments = len(tensors)
    num_fragments = draw(st.integers(1, max_fragments))
    sync_interval = draw(st.integers(1, 30))
    num_shards = draw(st.integers(1, num_fragments))
    plan = plan_fragments(tensors, num_fragments, sync_interval, num_shards, method)
    return tensors, num_fragments, sync_interval, num_shards, plan


# --- partition -------------------------------------------------------------------------------

@property_test
@given(plans())
def test_every_tensor_is_in_exactly_one_fragment_and_slots_tile_it(case):
    tensors, num_fragments, _, _, plan = case
    assert [f.id for f in plan.fragments] == list(range(num_fragments))
    placed = [slot.name for f in plan.fragments for slot in f.tensors]
    assert sorted(placed) == sorted(name for name, _ in tensors)

    position = {name: i for i, (name, _) in enumerate(tensors)}
    for fragment in plan.fragments:
        assert fragment.tensors, "an empty fragment could never be synced"
        offset = 0
        for slot in fragment.tensors:
            assert slot.offset == offset
            assert slot.numel == math.prod(slot.shape) >= 1
            assert plan.fragment_of(slot.name) is fragment
            offset += slot.numel
        assert fragment.numel == offset
        assert fragment.nbytes == 4 * fragment.numel
        # Slots keep the model's own order, so gather/scatter walk the model in order.
        positions = [position[slot.name] for slot in fragment.tensors]
        assert positions == sorted(positions)
    assert plan.total_numel == sum(math.prod(shape) for _, shape in tensors)


@property_test
@given(plans("balanced"))
def test_balanced_fragments_differ_by_at_most_the_largest_tensor(case):
    tensors, *_, plan = case
    sizes = [f.numel for f in plan.fragments]
    assert max(sizes) <= min(sizes) + max(math.prod(shape) for _, shape in tensors)


def test_balanced_packs_largest_first_onto_the_lightest_fragment():
    tensors = [("a", (4,)), ("c", (2,)), ("b", (3,)), ("d", (2,))]
    plan = plan_fragments(tensors, num_fragments=2, sync_interval=4)
    # a(4) -> 0, b(3) -> 1, c(2) -> 1 (3 < 4), d(2) -> 0 (4 < 5); equal sizes go by name.
    assert [[s.name for s in f.tensors] for f in plan.fragments] == [["a", "d"], ["c", "b"]]
    assert [[s.offset for s in f.tensors] for f in plan.fragments] == [[0, 4], [0, 2]]
    # Equal loads: the lowest-numbered fragment wins.
    plan = plan_fragments([("x", (2,)), ("y", (2,)), ("z", ())], num_fragments=2, sync_interval=1)
    assert [[s.name for s in f.tensors] for f in plan.fragments] == [["x", "z"], ["y"]]


# --- strided ---------------------------------------------------------------------------------

@property_test
@given(plans("strided"))
def test_strided_fragment_p_holds_exactly_the_layers_congruent_to_p(case):
    tensors, num_fragments, *_, plan = case
    for name, _ in tensors:
        layer = layer_of(name)
        if layer is not None:
            assert plan.fragment_of(name).id == layer % num_fragments
    for fragment in plan.fragments:
        assert any(layer_of(s.name) is not None for s in fragment.tensors)


def test_strided_layer_index_is_the_first_integer_path_component():
    tensors = [("transformer.wte.weight", (8, 2))]
    tensors += [(f"transformer.h.{i}.mlp.c_fc.weight", (2, 2)) for i in range(12)]
    tensors += [("transformer.h.2.moe.experts.7.weight", (4, 2))]
    tensors += [("transformer.ln_f.weight", (2,)), ("lm_head.0.weight", (3,))]
    plan = plan_fragments(tensors, num_fragments=4, sync_interval=8, method="strided")
    assert plan.fragment_of("transformer.h.11.mlp.c_fc.weight").id == 3
    assert plan.fragment_of("transformer.h.2.moe.experts.7.weight").id == 2  # layer 2, not 7
    assert plan.fragment_of("lm_head.0.weight").id == 0  # "0" is its first integer component
    # Fragments hold 12, 12, 20, 12 of layers, plus lm_head's 3 on fragment 0: wte (16) goes
    # to the lightest, 1, then ln_f (2) to the next lightest, 3.
    assert plan.fragment_of("transformer.wte.weight").id == 1
    assert plan.fragment_of("transformer.ln_f.weight").id == 3


# --- determinism -----------------------------------------------------------------------------

@property_test
@given(plans())
def test_plan_is_a_pure_function_of_its_inputs(case):
    tensors, num_fragments, sync_interval, num_shards, plan = case
    as_sizes = [(name, torch.Size(shape)) for name, shape in tensors]
    again = plan_fragments(as_sizes, num_fragments, sync_interval, num_shards, plan.method)
    assert again == plan
    assert re.fullmatch(r"[0-9a-f]{64}", plan.digest)


def _digest_cases():
    tensors = [("wte.weight", (50, 8)), ("ln_f.weight", (8,)), ("scale", ())]
    tensors += [(f"blocks.{i}.{leaf}", (8, 8 + i))
                for i in range(6) for leaf in ("attn.w", "mlp.w")]
    tensors += [("éμβ.ｗ", (3,)), ("b", (7,)), ("a", (7,))]  # unicode names, tied sizes
    return [(tensors, p, h, s, method)
            for method in ("balanced", "strided")
            for p, h, s in [(1, 1, 1), (2, 5, 2), (3, 24, 2), (6, 4, 3), (6, 24, 6)]]


def test_digest_is_identical_across_processes_and_hash_seeds():
    cases = _digest_cases()
    here = [(plan.digest, repr(plan)) for plan in (plan_fragments(*case) for case in cases)]
    code = ("import json, sys; from diloco.services.contract.fragments import plan_fragments; "
            "plans = [plan_fragments(*case) for case in json.load(sys.stdin)]; "
            "json.dump([(p.digest, repr(p)) for p in plans], sys.stdout)")
    children = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, env={**os.environ, "PYTHONHASHSEED": seed})
                for seed in ("1", "2")]
    outputs = [child.communicate(json.dumps(cases), timeout=60) for child in children]
    for child, (out, err) in zip(children, outputs):
        assert child.returncode == 0, err
        # JSON turned the shape tuples into lists: that must not matter either.
        assert [tuple(pair) for pair in json.loads(out)] == here


def test_digest_changes_with_anything_that_changes_the_plan():
    tensors = [(f"blocks.{i}.w", (4, 4)) for i in range(4)] + [("head.w", (4,))]
    base = plan_fragments(tensors, 2, 8, 1)
    variants = [
        plan_fragments(tensors, 2, 8, 1, method="strided"),
        plan_fragments(tensors, 2, 8, 2),
        plan_fragments(tensors, 2, 6, 1),
        plan_fragments(tensors, 4, 8, 1),
        plan_fragments(tensors[:-1] + [("head.w", (2, 2))], 2, 8, 1),  # same numel, new shape
        plan_fragments(tensors[:-1] + [("head.b", (4,))], 2, 8, 1),
        plan_fragments(tensors[::-1], 2, 8, 1),  # same members, different slot order
    ]
    digests = {base.digest} | {v.digest for v in variants}
    assert len(digests) == 1 + len(variants)


def test_digest_is_the_sha256_of_a_documented_canonical_form():
    # Learners and shards of different releases must agree on the digest of the same plan, so
    # the canonical form is pinned here; changing it means bumping its "format" tag.
    tensors = [("wte.weight", (16, 4)), ("blocks.0.w", (4, 4)), ("blocks.1.w", (4, 4)),
               ("ln_f", (4,))]
    plan = plan_fragments(tensors, num_fragments=2, sync_interval=24, num_shards=2)
    canonical = (
        '{"format":"diloco.fragment-plan/1","fragments":['
        '{"id":0,"offset_step":0,"shard":0,"tensors":[["wte.weight",[16,4]]]},'
        '{"id":1,"offset_step":12,"shard":1,"tensors":'
        '[["blocks.0.w",[4,4]],["blocks.1.w",[4,4]],["ln_f",[4]]]}'
        '],"method":"balanced","num_shards":2,"sync_interval":24}'
    )
    assert plan.digest == hashlib.sha256(canonical.encode()).hexdigest()


# --- offsets and shards ----------------------------------------------------------------------

@property_test
@given(plans(), st.integers(-1000, 1000))
def test_offsets_are_spread_and_every_fragment_is_due_once_per_interval(case, start):
    _, num_fragments, sync_interval, _, plan = case
    offsets = [f.offset_step for f in plan.fragments]
    assert all(0 <= t < sync_interval for t in offsets)
    assert offsets == sorted(offsets)
    assert max(collections.Counter(offsets).values()) <= math.ceil(num_fragments / sync_interval)
    due = [f.id for step in range(start, start + sync_interval) for f in plan.due_at(step)]
    assert sorted(due) == list(range(num_fragments))


def test_offsets_follow_the_formula():
    tensors = [(f"t{i}", (1,)) for i in range(6)]
    assert [f.offset_step for f in plan_fragments(tensors, 4, 24).fragments] == [0, 6, 12, 18]
    assert [f.offset_step for f in plan_fragments(tensors, 6, 4).fragments] == [0, 0, 1, 2, 2, 3]


@property_test
@given(plans())
def test_every_shard_owns_fragments_balanced_by_bytes(case):
    _, _, _, num_shards, plan = case
    owned = [plan.for_shard(s) for s in range(num_shards)]
    assert all(owned)
    assert sorted(f.id for fs in owned for f in fs) == [f.id for f in plan.fragments]
    assert all(f.shard == s for s, fs in enumerate(owned) for f in fs)
    loads = [sum(f.nbytes for f in fs) for fs in owned]
    assert max(loads) - min(loads) <= max(f.nbytes for f in plan.fragments)


def test_lookups_refuse_what_is_not_in_the_plan():
    plan = plan_fragments([("a", (2,)), ("b", (3,))], 2, 4, 2)
    with pytest.raises(KeyError, match="'c' is not in the fragment plan"):
        plan.fragment_of("c")
    with pytest.raises(ValueError, match="shard 2 out of range: the plan has 2 shard"):
        plan.for_shard(2)


# --- gather / scatter ------------------------------------------------------------------------

class TinyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(11, 4)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4)) for _ in range(4))
        self.head = nn.Linear(4, 3, bias=False)


def _bits(tensor):
    return tensor.detach().view(torch.int32)


@pytest.mark.parametrize("method,num_fragments", [("balanced", 1), ("balanced", 5), ("strided", 2),
                                                  ("strided", 4)])
def test_gather_scatter_round_trip_restores_the_exact_bits(method, num_fragments):
    torch.manual_seed(0)
    model = TinyModel()
    params = dict(model.named_parameters())
    manifest = [(name, p.shape) for name, p in params.items()]
    plan = plan_fragments(manifest, num_fragments, 8, method=method)
    original = {n: p.detach().clone() for n, p in params.items()}

    flats = [gather(f, params) for f in plan.fragments]
    for fragment, flat in zip(plan.fragments, flats):
        assert flat.dtype == torch.float32 and flat.shape == (fragment.numel,)
        assert not flat.requires_grad
        expected = torch.cat([original[s.name].reshape(-1) for s in fragment.tensors])
        assert torch.equal(_bits(flat), _bits(expected))

    # The gathered vector is a copy: changing it leaves the model alone.
    gather(plan.fragments[0], params).add_(1.0)
    assert all(torch.equal(_bits(p), _bits(original[n])) for n, p in params.items())

    with torch.no_grad():
        for p in params.values():
            p.normal_()
    for fragment, flat in zip(plan.fragments, flats):
        scatter(fragment, flat, params)
    for name, param in params.items():
        assert torch.equal(_bits(param), _bits(original[name])), name
        assert param.requires_grad


def test_scatter_refuses_a_vector_of_the_wrong_size():
    model = TinyModel()
    params = dict(model.named_parameters())
    fragment = plan_fragments([(n, p.shape) for n, p in params.items()], 2, 4).fragments[0]
    before = {n: p.detach().clone() for n, p in params.items()}
    for bad in (torch.zeros(fragment.numel + 1), torch.zeros(fragment.numel - 1),
                torch.zeros(1, fragment.numel)):
        with pytest.raises(ValueError, match=f"expects a 1-D vector of {fragment.numel} elements"):
            scatter(fragment, bad, params)
    assert all(torch.equal(p, before[n]) for n, p in params.items())


def test_gather_and_scatter_refuse_a_model_of_another_shape():
    fragment = plan_fragments([("w", (2, 3))], 1, 1).fragments[0]
    with pytest.raises(ValueError, match=r"'w' has shape \(3, 2\), the plan expects \(2, 3\)"):
        gather(fragment, {"w": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match=r"'w' has shape \(6,\)"):
        scatter(fragment, torch.zeros(6), {"w": torch.zeros(6)})


# --- bad input -------------------------------------------------------------------------------

TWO = [("a", (2,)), ("b", (3,))]
LAYERS = [("blocks.0.w", (2,)), ("blocks.1.w", (2,)), ("wte", (4,))]


@pytest.mark.parametrize("kwargs,message", [
    (dict(tensors=TWO, num_fragments=0), r"num_fragments must be >= 1, got 0"),
    (dict(tensors=TWO, sync_interval=0), r"sync_interval must be >= 1, got 0"),
    (dict(tensors=TWO, num_shards=0), r"num_shards must be >= 1, got 0"),
    (dict(tensors=TWO, num_fragments=3), r"num_fragments=3 exceeds the number of tensors \(2\)"),
    (dict(tensors=[], num_fragments=1), r"num_fragments=1 exceeds the number of tensors \(0\)"),
    (dict(tensors=TWO, num_fragments=2, num_shards=3), r"num_shards=3 exceeds num_fragments=2"),
    (dict(tensors=TWO + [("a", (1,))]), r"duplicate tensor name 'a'"),
    (dict(tensors=TWO + [("c", (2, 0))]),
     r"tensor 'c' has a non-positive dimension in shape \(2, 0\)"),
    (dict(tensors=TWO + [("c", (-1,))]), r"tensor 'c' has a non-positive dimension"),
    (dict(tensors=TWO + [("", (1,))]), r"tensor names must be non-empty strings"),
    (dict(tensors=TWO, method="layers"),
     r"unknown fragmentation method 'layers'; valid methods: balanced, strided"),
    (dict(tensors=LAYERS, num_fragments=3, method="strided"),
     r"at least num_fragments=3 layers, found 2"),
    (dict(tensors=[("h.0.w", (1,)), ("h.2.w", (1,)), ("h.4.w", (1,))], num_fragments=2,
          method="strided"),
     r"no layer index is congruent to 1 mod 2, so fragment 1 would hold no layer"),
])
def test_bad_input_is_refused_with_a_message_naming_the_problem(kwargs, message):
    args = dict(num_fragments=1, sync_interval=4) | kwargs
    with pytest.raises(ValueError, match=message):
        plan_fragments(**args)
