"""Upstream profiles: the defaults each fills, what the file overrides, which
configurations may resolve unknown outcomes, and the key the upstream gets."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from gateway.config import UpstreamSettings
from gateway.fencing.profiles import (
    PROFILES,
    Answer,
    answer_of,
    is_mismatch,
    statuses,
    upstream_key,
)


def up(**extra: Any) -> UpstreamSettings:
    return UpstreamSettings(**{"name": "pay", "url": "http://127.0.0.1:9", **extra})


def test_generic_is_todays_behaviour() -> None:
    assert up().profile == "generic" and up().dedup is None and up().dedup_header is None


@pytest.mark.parametrize(
    ("profile", "header", "window"),
    [
        ("stripe", "Idempotency-Key", 86400),
        ("paypal", "PayPal-Request-Id", 21600),
        ("checkout", "Cko-Idempotency-Key", 86400),
        ("s3", None, 86400),
    ],
)
def test_a_profile_fills_its_defaults(profile: str, header: str | None, window: float) -> None:
    settings = up(profile=profile, **(SIGNING if profile == "s3" else {}))
    assert settings.dedup is not None
    assert settings.dedup.header == header and settings.dedup.window_seconds == window
    if header is not None:
        assert header.lower() in settings.set_header_names  # a worker's is dropped


def test_the_file_overrides_a_profiles_defaults() -> None:
    settings = up(profile="stripe", dedup={"window_seconds": 3600})
    assert settings.dedup is not None
    assert settings.dedup.window_seconds == 3600
    assert settings.dedup.header == "Idempotency-Key"  # the rest from the profile
    generic = up(dedup={"header": "X-Dedup", "window_seconds": 60})
    assert generic.dedup_header == "X-Dedup"


def test_unknown_profile_and_bad_header_are_refused() -> None:
    with pytest.raises(ValidationError, match="profile"):
        up(profile="adyen-ish")
    with pytest.raises(ValidationError, match="header"):
        up(dedup={"header": "Bad Header"})
    with pytest.raises(ValidationError, match="set by the gateway"):
        up(dedup={"header": "Fencing-Job"})


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"profile": "generic"},
        {"profile": "stripe", "dedup": {"header": None}},
    ],
)
def test_resolve_is_refused_where_a_resend_is_not_safe(extra: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match="resolve"):
        up(unknown_outcome="resolve", **extra)


SIGNING: dict[str, Any] = {"signing": {"access_key_id": "AKID", "secret_access_key": "s"}}


def test_s3_needs_the_gateways_own_credentials_and_only_s3_takes_them() -> None:
    with pytest.raises(ValidationError, match="signing"):
        up(profile="s3")
    with pytest.raises(ValidationError, match="s3"):
        up(profile="stripe", **SIGNING)
    settings = up(profile="s3", unknown_outcome="resolve", **SIGNING)
    assert settings.signing is not None and settings.signing.region == "us-east-1"


def test_resolve_is_allowed_where_the_upstream_deduplicates() -> None:
    assert up(unknown_outcome="resolve", profile="stripe").unknown_outcome == "resolve"
    assert up(unknown_outcome="resolve", dedup={"header": "X-Key"}).dedup_header == "X-Key"


def test_every_profile_is_documented_with_its_source() -> None:
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "profiles.md").read_text()
    for name in PROFILES:
        assert f"`{name}`" in doc
    for source in (
        "docs.stripe.com",
        "developer.paypal.com",
        "checkout.com",
        "docs.aws.amazon.com",
    ):
        assert source in doc


KEY = re.compile(r"fg-[0-9a-f]{61}")


@given(st.text(min_size=1, max_size=200), st.text(min_size=1, max_size=255))
def test_the_upstream_key_is_stable_and_fits_every_profile(job: str, key: str) -> None:
    derived = upstream_key(job, key)
    assert KEY.fullmatch(derived) and len(derived) == 64
    assert upstream_key(job, key) == derived


@given(
    st.tuples(st.text(max_size=20), st.text(max_size=20)),
    st.tuples(st.text(max_size=20), st.text(max_size=20)),
)
def test_different_job_key_pairs_get_different_keys(a: tuple[str, str], b: tuple[str, str]) -> None:
    if a != b:
        assert upstream_key(*a) != upstream_key(*b)


def test_length_prefixes_keep_the_parts_apart() -> None:
    assert upstream_key("job-1", "2") != upstream_key("job-", "12")
    assert upstream_key("a", "bc") != upstream_key("ab", "c")


def test_mismatch_answers() -> None:
    body = b'{"error": {"type": "idempotency_error"}}'
    assert is_mismatch(400, body, 400, "idempotency_error")
    assert not is_mismatch(400, b'{"error": {"type": "card_error"}}', 400, "idempotency_error")
    assert not is_mismatch(409, body, 400, "idempotency_error")
    assert is_mismatch(409, b"", 409, None)
    assert not is_mismatch(409, b"", None, None)


def test_status_lists_name_statuses_and_classes() -> None:
    assert statuses([201, "4xx", "5XX"]) == {201} | set(range(400, 600))
    assert statuses([]) == frozenset()
    for bad in (99, 600, "6xx", "2x", "20x", "201", True, 2.5):
        with pytest.raises(ValueError, match="is not a status"):
            statuses([bad])  # type: ignore[list-item]


def test_bad_final_statuses_are_refused_by_the_config() -> None:
    with pytest.raises(ValidationError, match="is not a status"):
        up(dedup={"final_statuses": ["2xx", "7xx"]})


@pytest.mark.parametrize(
    ("extra", "status", "whole", "answer"),
    [
        ({}, 201, True, Answer.FINAL),
        ({}, 500, True, Answer.FINAL),
        ({}, 201, False, Answer.UNKNOWN),  # cut short
        ({}, 502, True, Answer.UNKNOWN),
        ({}, 429, True, Answer.NOT_PROCESSED),
        ({"profile": "stripe"}, 400, True, Answer.NOT_PROCESSED),  # failed validation
        ({"profile": "stripe"}, 409, True, Answer.NOT_PROCESSED),  # a concurrent request
        ({"profile": "stripe"}, 402, True, Answer.FINAL),  # declined: the endpoint ran
        ({"profile": "stripe"}, 500, True, Answer.FINAL),  # Stripe saves 500s
        ({"profile": "stripe"}, 504, True, Answer.UNKNOWN),
        ({"profile": "checkout"}, 422, True, Answer.NOT_PROCESSED),
        ({"profile": "checkout"}, 429, True, Answer.NOT_PROCESSED),
        ({"profile": "s3"}, 412, True, Answer.FINAL),
        ({"dedup": {"final_statuses": ["5xx"]}}, 503, True, Answer.NOT_PROCESSED),
        (
            {"dedup": {"final_statuses": ["5xx"]}, "not_processed_statuses": []},
            503,
            True,
            Answer.FINAL,
        ),
    ],
)
def test_what_an_answer_does_to_the_key(
    extra: dict[str, Any], status: int, whole: bool, answer: Answer
) -> None:
    if extra.get("profile") == "s3":
        extra = {**extra, "signing": {"access_key_id": "a", "secret_access_key": "b"}}
    assert up(**extra).answer_of(status, whole=whole) is answer


@pytest.mark.parametrize(
    ("extra", "status", "precondition", "whole", "answer"),
    [
        # S3's 412 to the request's own If-None-Match / If-Match: nothing was applied,
        # decided on the head alone (the body is S3's XML, never read).
        ({"profile": "s3"}, 412, True, True, Answer.PRECONDITION_FAILED),
        ({"profile": "s3"}, 412, True, False, Answer.PRECONDITION_FAILED),
        # ... even where the file names 412 "not processed": the precondition comes first.
        (
            {"profile": "s3", "not_processed_statuses": [412, 429, 503]},
            412,
            True,
            True,
            Answer.PRECONDITION_FAILED,
        ),
        ({"profile": "s3"}, 412, False, True, Answer.FINAL),  # no precondition of its own
        ({"profile": "s3"}, 200, True, True, Answer.FINAL),  # the precondition held
        ({"profile": "s3"}, 502, True, True, Answer.UNKNOWN),
        # Only an S3 upstream's 412 is read this way; any other's stays as it was.
        ({}, 412, True, True, Answer.FINAL),
        ({"profile": "stripe"}, 412, True, True, Answer.NOT_PROCESSED),  # not in 2xx/402/...
    ],
)
def test_a_412_to_the_requests_own_precondition(
    extra: dict[str, Any], status: int, precondition: bool, whole: bool, answer: Answer
) -> None:
    if extra.get("profile") == "s3":
        extra = {**extra, **SIGNING}
    settings = up(**extra)
    assert settings.answer_of(status, whole=whole, precondition=precondition) is answer


def test_the_precondition_rule_itself_knows_no_profile() -> None:
    """``profiles.answer_of`` is told whether the upstream judged a precondition; the
    upstream's settings say which upstreams do (S3)."""
    rule = {"not_processed": frozenset({429, 503}), "final": None}
    assert answer_of(412, whole=True, precondition=True, **rule) is Answer.PRECONDITION_FAILED
    assert answer_of(412, whole=True, **rule) is Answer.FINAL
    assert answer_of(409, whole=True, precondition=True, **rule) is Answer.FINAL


def test_signing_credentials_come_from_the_environment_and_stay_secret() -> None:
    from gateway.config import ConfigError, Settings, env_references, resolve_secrets

    signing = {"access_key_id": "${AK}", "secret_access_key": "${SK}"}
    settings = Settings(
        upstreams=[
            {"name": "files", "url": "http://127.0.0.1:9", "profile": "s3", "signing": signing}
        ]
    )
    assert {ref for _, ref, _ in env_references(settings, {})} == {"AK", "SK"}
    with pytest.raises(ConfigError, match="SK"):
        resolve_secrets(settings, {"AK": "AKIDEXAMPLE"})
    resolved = resolve_secrets(settings, {"AK": "AKIDEXAMPLE", "SK": "wJalrXUtnFEMI"})
    [files] = resolved.upstreams
    assert files.signing is not None
    assert files.signing.secret_access_key.get_secret_value() == "wJalrXUtnFEMI"
    assert "wJalrXUtnFEMI" in resolved.secret_values()
    assert "wJalrXUtnFEMI" not in repr(files) and "wJalrXUtnFEMI" not in str(files.summary())
