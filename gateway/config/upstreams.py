"""``[[upstreams]]``: the services the gateway forwards to, what each guarantees by
itself (``[upstreams.dedup]``) and the credentials the gateway signs with for an S3 one
(``[upstreams.signing]``). ``${NAME}`` in ``set_headers`` and ``signing`` stays as written
here; ``gateway.config.secrets.resolve_secrets`` expands it."""

from __future__ import annotations

import re
from functools import cached_property
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from yarl import URL

from gateway.fencing.fence import UnknownOutcome
from gateway.fencing.profiles import PROFILES, Answer, Profile, answer_of, statuses

TOKEN_CHARS = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


def mask_url(value: str) -> str:
    """``https://user:pw@host/x`` as ``https://user:***@host/x``; ``https://key@host`` as
    ``https://***@host``."""
    url = URL(value)
    if url.password is not None:
        return str(url.with_password("***"))
    if url.user is not None:
        return str(url.with_user("***"))
    return value


class DedupSettings(BaseModel):
    """What the upstream guarantees by itself (``[upstreams.dedup]``; a profile fills
    the defaults, ``gateway.fencing.profiles``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # The header in which the upstream reads an idempotency key; the gateway sends its
    # own key there (``profiles.upstream_key``). None: the upstream reads no key.
    header: str | None = None
    # How long the upstream remembers a key: a held write is re-sent only inside it.
    window_seconds: float = Field(86400.0, gt=0, le=90 * 86400, allow_inf_nan=False)
    # The upstream's answer that a key was used before with other parameters: this
    # status, and (when set) this text in its body.
    mismatch_status: int | None = Field(None, ge=100, le=599)
    mismatch_contains: str | None = Field(None, min_length=1, max_length=200)
    # The answers the upstream keeps as the key's (statuses, or classes such as "2xx");
    # any other answer leaves the key free, as ``not_processed_statuses`` do. None:
    # every whole answer is final but those. 502 and 504 stay unknown outcomes.
    final_statuses: list[int | str] | None = Field(None, max_length=600)

    @field_validator("final_statuses")
    @classmethod
    def _final(cls, value: list[int | str] | None) -> list[int | str] | None:
        if value is not None:
            statuses(value)
        return value

    @cached_property
    def final(self) -> frozenset[int] | None:
        return None if self.final_statuses is None else statuses(self.final_statuses)

    @field_validator("header")
    @classmethod
    def _header(cls, value: str | None) -> str | None:
        if value is not None and not TOKEN_CHARS.fullmatch(value):
            raise ValueError(f"{value!r} is not a header name")
        if value is not None and value.lower() in _GATEWAY_HEADERS:
            raise ValueError(f"{value} is set by the gateway itself")
        return value


class SigningSettings(BaseModel):
    """The gateway's own AWS credentials for ``profile = "s3"``: it signs every request
    it forwards there with AWS Signature Version 4 (botocore's signer). ``${NAME}`` is
    expanded from the environment by ``resolve_secrets``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    access_key_id: SecretStr
    secret_access_key: SecretStr
    session_token: SecretStr | None = None
    region: str = Field("us-east-1", pattern=r"^[a-z0-9-]{1,40}$")

    def secrets(self) -> dict[str, SecretStr]:
        found = {"access_key_id": self.access_key_id, "secret_access_key": self.secret_access_key}
        if self.session_token is not None:
            found["session_token"] = self.session_token
        return found


# Headers the gateway sets on every fenced write; no dedup header may be one of them.
_GATEWAY_HEADERS = frozenset({"fencing-token", "fencing-job", "fencing-generation", "host"})


class UpstreamSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
    url: str
    fenced_methods: list[str] = Field(default_factory=lambda: ["POST", "PUT", "PATCH", "DELETE"])
    require_idempotency_key: bool = True
    timeout_seconds: float = Field(10.0, gt=0, le=3600, allow_inf_nan=False)
    connect_timeout_seconds: float = Field(5.0, gt=0, le=600, allow_inf_nan=False)
    max_body_bytes: int = Field(10 * 1024 * 1024, ge=0, le=2**34)
    set_headers: dict[str, SecretStr] = Field(default_factory=dict)
    # "resolve": the gateway re-sends a held write itself (docs/profiles.md); only
    # where the upstream deduplicates by key or a precondition makes it safe.
    unknown_outcome: UnknownOutcome = UnknownOutcome.HOLD
    profile: Profile = "generic"
    dedup: DedupSettings | None = None
    # profile = "s3" only, and required there: the credentials the gateway signs with.
    signing: SigningSettings | None = None
    # Answers that mean "not processed, try later": the worker gets them, but they are
    # not the key's answer, so the key stays free for the next attempt.
    not_processed_statuses: list[Annotated[int, Field(ge=100, le=599)]] = Field(
        default_factory=lambda: [429, 503]
    )
    # Query parameters that may appear in this upstream's audit entries; every other one
    # is left out (a query can carry credentials: ``?api_key=``).
    audit_query_params: list[str] = Field(default_factory=list, max_length=100)

    def summary(self) -> dict[str, Any]:
        """What operators may see of this upstream (header names, never their values)."""
        return {
            "name": self.name,
            "url": self.display_url,
            "fenced_methods": self.fenced_methods,
            "require_idempotency_key": self.require_idempotency_key,
            "timeout_seconds": self.timeout_seconds,
            "max_body_bytes": self.max_body_bytes,
            "unknown_outcome": self.unknown_outcome,
            "profile": self.profile,
            "dedup": None if self.dedup is None else self.dedup.model_dump(),
            # Where it signs, never with what.
            "signing": None if self.signing is None else {"region": self.signing.region},
            "not_processed_statuses": self.not_processed_statuses,
            "audit_query_params": self.audit_query_params,
            "set_headers": sorted(self.set_headers),
        }

    @cached_property
    def set_header_names(self) -> frozenset[str]:
        """Headers the gateway sets itself for this upstream (a client's are dropped)."""
        names = {name.lower() for name in self.set_headers}
        if self.dedup_header is not None:
            names.add(self.dedup_header.lower())
        return frozenset(names)

    @property
    def dedup_header(self) -> str | None:
        return None if self.dedup is None else self.dedup.header

    @model_validator(mode="before")
    @classmethod
    def _profile_defaults(cls, data: Any) -> Any:
        """The profile's ``[upstreams.dedup]`` defaults under what the file says."""
        if not isinstance(data, dict):
            return data
        defaults = PROFILES.get(str(data.get("profile", "generic")))
        given = data.get("dedup")
        if defaults is None or (given is not None and not isinstance(given, dict)):
            return data
        return {**data, "dedup": {**defaults, **(given or {})}}

    @model_validator(mode="after")
    def _signing(self) -> UpstreamSettings:
        if self.profile == "s3" and self.signing is None:
            raise ValueError(
                'profile = "s3" needs [upstreams.signing] access_key_id and secret_access_key '
                "(the gateway signs every request with them; workers hold no credentials)"
            )
        if self.profile != "s3" and self.signing is not None:
            raise ValueError('[upstreams.signing] is for profile = "s3" only')
        return self

    @model_validator(mode="after")
    def _resolvable(self) -> UpstreamSettings:
        if self.unknown_outcome == UnknownOutcome.RESOLVE and (
            self.dedup is None or (self.dedup.header is None and self.profile != "s3")
        ):
            raise ValueError(
                'unknown_outcome = "resolve" needs an upstream that deduplicates by key '
                "([upstreams.dedup] header, or a profile that sets it), or profile = s3"
            )
        return self

    @cached_property
    def not_processed(self) -> frozenset[int]:
        return frozenset(self.not_processed_statuses)

    def answer_of(self, status: int, *, whole: bool = True, precondition: bool = False) -> Answer:
        """What this upstream's answer (``whole``: read to its end) does to the key.
        ``precondition``: the request carried ``If-None-Match`` or ``If-Match``; only an
        S3 upstream's 412 to one is taken as "not applied" (docs/profiles.md)."""
        return answer_of(
            status,
            whole=whole,
            not_processed=self.not_processed,
            final=None if self.dedup is None else self.dedup.final,
            precondition=precondition and self.profile == "s3",
        )

    @property
    def display_url(self) -> str:
        """The URL as it may be shown: a password (or a lone user name, which services
        such as Stripe use as the key) becomes ``***``."""
        return mask_url(self.url)

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        url = URL(value)
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError("must be an absolute http:// or https:// URL")
        if url.query_string or url.fragment:
            raise ValueError("must not carry a query or a fragment")
        return value.rstrip("/")

    @field_validator("fenced_methods")
    @classmethod
    def _methods(cls, value: list[str]) -> list[str]:
        methods = [m.upper() for m in value]
        for method in methods:
            if not TOKEN_CHARS.fullmatch(method):
                raise ValueError(f"{method!r} is not an HTTP method")
        # HEAD follows GET: most frameworks answer HEAD with the GET handler.
        if "GET" in methods and "HEAD" not in methods:
            methods.append("HEAD")
        return methods

    @field_validator("audit_query_params")
    @classmethod
    def _param_names(cls, value: list[str]) -> list[str]:
        for name in value:
            if not 1 <= len(name) <= 200 or any(c in name for c in "&=#\r\n\0"):
                raise ValueError(f"{name[:50]!r} is not a query parameter name")
        return value

    @field_validator("set_headers")
    @classmethod
    def _header_names(cls, value: dict[str, SecretStr]) -> dict[str, SecretStr]:
        for name, header in value.items():
            if not TOKEN_CHARS.fullmatch(name):
                raise ValueError(f"{name!r} is not a header name")
            if any(c in header.get_secret_value() for c in "\r\n\0"):
                raise ValueError(f"the value of {name} contains a line break or NUL")
        return value
