"""The log redaction, as a pure function over text."""

from __future__ import annotations

import pytest

from gateway.observe.logs import redact


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("b'Authorization: Bearer adm-0123456789abcdef\\x01'", "adm-0123456789abcdef"),
        ("Authorization: adm-0123456789abcdef", "adm-0123456789abcdef"),
        ("{'authorization': 'Basic dXNlcjpwYXNz'}", "dXNlcjpwYXNz"),
        ('{"Fencing-Token": "etcd:lock/abc-123"}', "etcd:lock/abc-123"),
        ("sent Bearer tok-0123456789 to the API", "tok-0123456789"),
        ("X-Api-Key: key-0123456789", "key-0123456789"),
        ("GET https://user:pa55word@api.example.com/x", "pa55word"),
        ("postgresql+asyncpg://fg:s3cret@db:5432/fg", "s3cret"),
        ("token fgl_ABCDEFGHIJKLMNOPQRSTUVWXYZ012345 refused", "IJKLMNOPQRSTUVWXYZ012345"),
    ],
)
def test_credentials_are_redacted(text: str, secret: str) -> None:
    clean = redact(text)
    assert secret not in clean
    assert "[redacted]" in clean or "***" in clean or "…" in clean


def test_ordinary_text_is_kept() -> None:
    text = "answered stale-generation 409 for job order-7 on /pay/charges"
    assert redact(text) == text
