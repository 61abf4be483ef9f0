"""Settings of the lease service (the ``[lease]`` table of the config file)."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, model_validator


class LeaseSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    default_ttl_seconds: float = Field(30.0, gt=0, allow_inf_nan=False)
    max_ttl_seconds: float = Field(600.0, gt=0, allow_inf_nan=False)
    default_max_attempts: int = Field(3, ge=1, le=1000)
    default_queue: str = Field("default", pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@~+=-]{0,199}$")
    max_retry_in_seconds: float = Field(86400.0 * 30, gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _default_within_max(self) -> LeaseSettings:
        if self.default_ttl_seconds > self.max_ttl_seconds or not math.isfinite(
            self.default_ttl_seconds
        ):
            raise ValueError("default_ttl_seconds must not exceed max_ttl_seconds")
        return self
