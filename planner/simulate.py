"""One simulated run: a mode, the inputs, the failures they draw."""
from __future__ import annotations

from typing import Callable

from diloco.planner.dataparallel import simulate_dp, simulate_elastic
from diloco.planner.diloco import simulate_diloco
from diloco.planner.failures import FailureModel
from diloco.planner.inputs import PlanInputs
from diloco.planner.outcome import PlanResult

SIMULATORS = {"dp": simulate_dp, "elastic": simulate_elastic, "diloco": simulate_diloco}
MODES = tuple(SIMULATORS)


def simulate(inputs: PlanInputs, mode: str, progress: Callable[[float], None] = lambda seconds: None) -> PlanResult:
    """`progress` is called with the virtual seconds reached after every event (diloco: each
    action of the event queue; dp, elastic: each stretch between fleet changes)."""
    return SIMULATORS[mode](inputs, FailureModel.from_inputs(inputs), progress)
