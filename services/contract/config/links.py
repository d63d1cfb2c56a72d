"""The links between a learner and the shards as the local cluster emulates them
(localcluster/wan.py) and `diloco plan` models them: no process of a deployment reads them."""
from __future__ import annotations

from typing import Annotated

from pydantic import Field

from diloco.services.contract.config.base import PositiveFloat, Section


class LinkConfig(Section):
    """A learner's link to the syncer, as the local cluster emulates it (localcluster/wan.py:
    WanLink) and `diloco plan` models it: a rate each way and the one-way latency."""
    up_mbps: PositiveFloat | None = None  # pushes; None: rpc.wan_mbps, else uncapped
    down_mbps: PositiveFloat | None = None  # pulls; None: rpc.wan_mbps, else uncapped
    latency_ms: Annotated[float, Field(ge=0.0)] = 0.0  # one way: a call waits it out and back
