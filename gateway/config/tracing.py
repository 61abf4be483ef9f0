"""``[tracing]``: where and how the gateway's OpenTelemetry spans go."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator
from yarl import URL


class TracingSettings(BaseModel):
    """OpenTelemetry spans (``gateway.observe.tracing``), exported over OTLP/HTTP; needs the
    ``otel`` extra."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    # Empty: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT, as the
    # exporter reads them, else http://localhost:4318/v1/traces.
    otlp_endpoint: str = ""
    service_name: str = Field("fencegate", min_length=1, max_length=200)
    # Traces started here (no sampled parent) kept at this ratio; a worker's sampled
    # traceparent is followed.
    sample_ratio: float = Field(1.0, ge=0, le=1, allow_inf_nan=False)

    @field_validator("otlp_endpoint")
    @classmethod
    def _endpoint(cls, value: str) -> str:
        if value:
            url = URL(value)
            if url.scheme not in ("http", "https") or not url.host:
                raise ValueError("must be an http:// or https:// URL (the OTLP/HTTP traces URL)")
        return value
