"""``kind_of``: what the parser found wrong with a request, never any of its bytes."""

from __future__ import annotations

import pytest
from aiohttp.http_exceptions import BadHttpMessage

from gateway.service.parse_errors import kind_of


@pytest.mark.parametrize(
    ("message", "kind"),
    [
        ("Invalid header value char", "Invalid header value char"),
        # llhttp's later lines quote the bytes: only the first line's words are kept.
        (
            'Invalid header value char:\n\n  b"Authorization: Bearer fgl_secret"\n   ^',
            "Invalid header value char",
        ),
        ("Invalid method encountered:", "Invalid method encountered"),
        ("A" + "b" * 80, "A" + "b" * 80),  # the longest kind kept
        # Anything else on the first line: only the error's class is named.
        ('Bad status line "GET /?api_key=s3cret"', "BadHttpMessage"),
        ("A" + "b" * 81, "BadHttpMessage"),  # too long to be a kind
        ("1 bad", "BadHttpMessage"),  # a kind starts with a letter
        ("", "BadHttpMessage"),
    ],
)
def test_the_kind_is_the_first_line_or_the_class(message: str, kind: str) -> None:
    assert kind_of(BadHttpMessage(message)) == kind


def test_other_errors_are_named_by_their_class() -> None:
    assert kind_of(ValueError("Authorization: Bearer fgl_secret")) == "ValueError"
    assert kind_of(None) == "malformed request"
