"""What every section of the config builds on: the error that names a key, strict sections
(a typo is an error, "4" is not 4), and the value types the sections share."""
from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field



class ConfigError(ValueError):
    """A configuration file that cannot describe a run; the message names the key."""


class Section(BaseModel):
    # strict: "4" is not 4 and 1.5 is not an int; extra="forbid": typos are errors.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
Port = Annotated[int, Field(ge=0, le=65535)]
HostPort = Annotated[str, Field(pattern=r"^[^\s:]+:\d{1,5}$|^\[[0-9a-fA-F:]+\]:\d{1,5}$")]
Identifier = Annotated[str, Field(pattern=r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$")]
