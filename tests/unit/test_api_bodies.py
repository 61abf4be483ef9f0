"""The lease API's reading of JSON bodies: the quick test that spares most bodies the
walk for NUL characters must never spare one that holds a NUL, in any encoding JSON may
arrive in."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from lease_core import api

ENCODINGS = ("utf-8", "utf-8-sig", "utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


def holds_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any("\x00" in key or holds_nul(item) for key, item in value.items())
    if isinstance(value, list):
        return any(holds_nul(item) for item in value)
    return False


@given(
    value=st.dictionaries(st.text(), json_values, max_size=4),
    encoding=st.sampled_from(ENCODINGS),
    ascii_only=st.booleans(),
)
def test_a_body_that_holds_a_nul_is_always_walked(
    value: dict[str, Any], encoding: str, ascii_only: bool
) -> None:
    raw = json.dumps(value, ensure_ascii=ascii_only).encode(encoding)
    assert api.parse_json(raw) == value
    if holds_nul(value):
        assert api.may_hold_nul(raw)


def test_an_ordinary_utf8_body_is_not_walked() -> None:
    raw = json.dumps({"lease_token": "fgl_" + "A" * 32, "ttl_seconds": 30.0}).encode()
    assert not api.may_hold_nul(raw)
    # A backslash before the u is text, not an escape, but sends the body to the walk.
    assert api.may_hold_nul(json.dumps({"note": "\\u0000"}).encode())
    assert api.may_hold_nul(json.dumps({"s": "a\x00b"}).encode())
    assert api.may_hold_nul(json.dumps({"a\x00": 1}, ensure_ascii=False).encode())
