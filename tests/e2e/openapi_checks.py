"""Schemathesis's hooks for tests/e2e/test_openapi_process.py (``SCHEMATHESIS_HOOKS``):
the check that every 4xx of the control listener is a problem document."""

from __future__ import annotations

import json
from typing import Any

import schemathesis

from fencegate_client.reasons import REASONS, Reason

PROBLEM = "application/problem+json"
SENT = {r.value for r in REASONS} | {Reason.HTTP_ERROR.value}


@schemathesis.check
def problem_document_on_4xx(ctx: Any, response: Any, case: Any) -> bool | None:
    """A 4xx is an RFC 9457 document: its media type, ``type``, ``title``, ``status``
    (the answer's), ``detail`` and a ``reason`` of ``REASONS`` whose ``type`` it names."""
    if not 400 <= response.status_code < 500:
        return None
    media = (response.headers.get("content-type") or [""])[0].split(";")[0].strip()
    assert media == PROBLEM, f"{response.status_code} answered as {media!r}, not {PROBLEM}"
    doc = json.loads(response.content)
    assert isinstance(doc, dict), doc
    missing = {"type", "title", "status", "detail", "reason"} - set(doc)
    assert not missing, f"problem document without {sorted(missing)}: {doc}"
    assert doc["status"] == response.status_code, doc
    assert doc["reason"] in SENT, f"unknown reason {doc['reason']!r}"
    assert doc["type"] == f"https://fencegate.dev/problems/{doc['reason']}", doc
    info = REASONS.get(Reason(doc["reason"]))
    if info is not None:
        assert info.status == response.status_code, (doc["reason"], response.status_code)
    return True
