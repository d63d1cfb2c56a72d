"""The inner optimizer: AdamW (Loshchilov & Hutter, decoupled weight decay), exactly the update
torch.optim.AdamW makes on CPU tensors, in a page.

Why not torch.optim.AdamW itself: torch.optim wraps Optimizer methods so that torch.compile
leaves them alone, and the first call of any of them imports torch._dynamo. That import is
paid by every learner start (bench/history.md has what it took), and every restart after a
failure is start-up badput. This learner never compiles anything.

    optimizer = AdamW([{"params": matrices, "weight_decay": 0.1},
                       {"params": vectors, "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.95))
    loss.backward(); optimizer.step(); optimizer.zero_grad()
    group["lr"] = ...                             # a schedule sets each group's lr between steps
    optimizer.load_state_dict(optimizer.state_dict())
"""
from __future__ import annotations

import torch


class AdamW:
    def __init__(self, param_groups: list[dict], lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01):
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        self.param_groups = [{**defaults, **group, "params": list(group["params"])} for group in param_groups]
        # Per parameter, once it has had a gradient: step count, first and second moments.
        self.state: dict[torch.Tensor, dict] = {}

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def zero_grad(self) -> None:
        for p in self._params():
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state.get(p)
                if state is None:
                    state = self.state[p] = {"step": 0, "exp_avg": torch.zeros_like(p),
                                             "exp_avg_sq": torch.zeros_like(p)}
                state["step"] += 1
                step, exp_avg, exp_avg_sq = state["step"], state["exp_avg"], state["exp_avg_sq"]
                # The operations and their order are torch.optim.AdamW's, so results match it bit for bit.
                if decay != 0:
                    p.mul_(1 - lr * decay)
                exp_avg.lerp_(p.grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                step_size = lr / (1 - beta1 ** step)
                denom = (exp_avg_sq.sqrt() / (1 - beta2 ** step) ** 0.5).add_(eps)
                p.addcdiv_(exp_avg, denom, value=-step_size)

    def state_dict(self) -> dict:
        """The state as torch.optim lays it out: parameters by their index across the groups
        (the tensors themselves, not copies; checkpoint_state copies them)."""
        index = {p: i for i, p in enumerate(self._params())}
        return {
            "state": {index[p]: dict(state) for p, state in self.state.items()},
            "param_groups": [{**group, "params": [index[p] for p in group["params"]]}
                             for group in self.param_groups],
        }

    def load_state_dict(self, saved: dict) -> None:
        groups = saved["param_groups"]
        shapes = [len(group["params"]) for group in self.param_groups]
        if [len(group["params"]) for group in groups] != shapes:
            raise ValueError(f"optimizer state has groups of {[len(g['params']) for g in groups]} "
                             f"parameters, this optimizer {shapes}")
        params = self._params()
        state = {}
        for i, saved_state in saved["state"].items():
            p = params[int(i)]
            if saved_state["exp_avg"].shape != p.shape:
                raise ValueError(f"optimizer state of parameter {i} has shape "
                                 f"{tuple(saved_state['exp_avg'].shape)}, the parameter {tuple(p.shape)}")
            # Copied onto the parameter's device (a checkpoint is loaded onto the CPU).
            state[p] = {"step": int(saved_state["step"]), "exp_avg": saved_state["exp_avg"].to(p.device, copy=True),
                        "exp_avg_sq": saved_state["exp_avg_sq"].to(p.device, copy=True)}
        for group, saved_group in zip(self.param_groups, groups):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        self.state = state
