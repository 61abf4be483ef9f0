"""``[auth]``: the tokens of the control API's callers, the workers and the scrapers."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator


class AuthSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    worker_tokens: list[SecretStr] = Field(default_factory=list)
    admin_tokens: list[SecretStr] = Field(default_factory=list)
    # Scrape credentials: they may read /metrics and nothing else.
    metrics_tokens: list[SecretStr] = Field(default_factory=list)

    @field_validator("worker_tokens", "admin_tokens", "metrics_tokens")
    @classmethod
    def _long_enough(cls, tokens: list[SecretStr]) -> list[SecretStr]:
        for token in tokens:
            if len(token.get_secret_value()) < 16:
                raise ValueError("each token must be at least 16 characters")
        return tokens

    @property
    def enabled(self) -> bool:
        return bool(self.worker_tokens or self.admin_tokens or self.metrics_tokens)
