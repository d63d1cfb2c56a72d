"""The tensors a learner syncs, and the check that they are still the model's: a parameter
replaced between steps (a new nn.Parameter, or `.data =`) would be synced from a tensor
training no longer updates."""
from __future__ import annotations

import torch
from torch import nn


def named_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters by name, in the model's order, each shared (tied) tensor once."""
    return dict(model.named_parameters())


def manifest(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter: what the fragment planner takes."""
    return [(name, tuple(param.shape)) for name, param in model.named_parameters()]


class SyncedParameters:
    """The model's parameters as they are when taken (on entering the learner's block):
    moving the model (model.to(device), a dtype) before that is fine, replacing parameters
    after it is not."""

    def __init__(self, model: nn.Module, expected_manifest: list[tuple[str, tuple[int, ...]]]):
        if manifest(model) != expected_manifest:
            raise RuntimeError("DecoupledDiLoCo: the model's parameter names or shapes changed since this "
                               "DecoupledDiLoCo was made; make it from the model you train")
        self.model = model
        self.params: dict[str, torch.Tensor] = named_parameters(model)
        self._storage = [p.data_ptr() for p in self.params.values()]
        # The module and attribute holding each parameter: a new nn.Parameter set there is seen
        # at the next step, before a sync gathers from the tensor training no longer updates.
        self._owners = [(model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2])
                        for name in self.params]

    def check(self, by_name: bool = False) -> None:
        """Raises unless every synced tensor is still the model's. `by_name` also catches a
        replaced submodule (it walks the whole model: on syncs only)."""
        replaced = [name for (name, p), ptr, (module, attr) in zip(self.params.items(), self._storage, self._owners)
                    if p.data_ptr() != ptr or module._parameters.get(attr) is not p]
        if not replaced and by_name:
            current = dict(self.model.named_parameters())
            replaced = [name for name, p in self.params.items() if current.get(name) is not p] \
                + [name for name in current if name not in self.params]
        if replaced:
            raise RuntimeError(f"DecoupledDiLoCo: parameter(s) {', '.join(replaced)} of the model "
                               "were replaced by new tensors since the learner joined; update them in place "
                               "(param.data.copy_(...), optimizer steps) so the synced tensors stay the model's")
