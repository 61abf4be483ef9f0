"""The proxy listener's fenced writes in the OpenAPI document (``openapi.py``): the
headers a worker sends and gets back, every problem the gateway answers itself (from
``REASONS``, grouped by status), and, as the document's ``webhooks``, the request that
reaches the upstream."""

from __future__ import annotations

from typing import Any

from fencegate_client import protocol
from fencegate_client.reasons import REASONS, Layer, Reason
from gateway.fencing import after_forward
from lease_core.problems import CONTENT_TYPE

FENCED_METHODS = ("post", "put", "patch", "delete")
PROXY_PATH = "/{upstream}/{path}"
REF = "#/components/schemas/Problem-{reason}"

HEADER = {"type": "string"}
KEY_RULE = (
    'A structured-field string ("abc") or a bare run of RFC 9110 token characters (it may '
    "start with a digit, as a UUID does); 1 to 255 characters."
)
KEY = {"type": "string", "minLength": 1, "maxLength": 257, "description": KEY_RULE}
# Any bytes, passed through as they are (the worker's Content-Type goes with them): named
# application/octet-stream, which client generators know. An answer is the upstream's.
ANY_BODY = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
# A JSON write, listed first: a generated client's defaults then serialise
# ``body: {amount: 700}`` and set its Content-Type, with no serializer of the user's. Typed
# as an object, not as the empty schema (any value): openapi-python-client turns ``{}``
# into ``isinstance(body, Any)``, which raises, and a union with an array into
# ``isinstance(body, list[Any])``, which raises too. Any other JSON value passes as well,
# sent as bytes with its own Content-Type.
JSON_OBJECT = {
    "type": "object",
    "additionalProperties": {},
    "description": "A JSON object, forwarded as it is serialised. Any other JSON value (an "
    "array, a scalar) is forwarded just the same: send it as bytes with its Content-Type.",
}
JSON_OR_ANY_BODY = {"application/json": {"schema": JSON_OBJECT}, **ANY_BODY}
UPSTREAM_ANSWER = {"application/json": {"schema": {}}, **ANY_BODY}


def gateway_reasons() -> list[Reason]:
    return [r for r, info in REASONS.items() if Layer.GATEWAY in info.layers]


def problems_by_status() -> dict[str, Any]:
    by_status: dict[int, list[Reason]] = {}
    for reason in gateway_reasons():
        by_status.setdefault(REASONS[reason].status, []).append(reason)
    out: dict[str, Any] = {}
    for status, group in sorted(by_status.items()):
        refs = [{"$ref": REF.format(reason=r.value)} for r in group]
        response: dict[str, Any] = {
            "description": "The gateway's own answer: " + "; ".join(_told(r) for r in group),
            "content": {CONTENT_TYPE: {"schema": refs[0] if len(refs) == 1 else {"oneOf": refs}}},
        }
        if any(REASONS[r].retry_after for r in group):
            response["headers"] = {"Retry-After": {"$ref": "#/components/headers/Retry-After"}}
        out[str(status)] = response
    return out


def _told(reason: Reason) -> str:
    """A reason as a response's description tells it: its name, what became of the write
    (its ``sent``) and its details."""
    info = REASONS[reason]
    details = " | ".join(after_forward.documented(reason) or [info.detail])
    sent = f"sent {info.sent.value}: " if info.sent is not None else ""
    return f"{reason.value} ({sent}{details})"


def fenced_write(method: str) -> dict[str, Any]:
    return {
        "operationId": f"proxy_{method}",
        "tags": ["proxy"],
        "summary": f"A fenced {method.upper()} to an upstream",
        "description": "Checked against the lease behind Fencing-Token, then forwarded to the "
        "upstream's base URL + /{path} only if it is current and new (the request that "
        "reaches the upstream is the webhook forwarded-write). A duplicate (same key, same "
        "request, already answered) gets the stored answer with Idempotent-Replayed: true; "
        "every other answer the gateway gives itself is a problem document listed here. "
        "Methods that are not fenced pass through unchecked.",
        "security": [],
        "parameters": _write_parameters(),
        "requestBody": {
            "required": False,
            "description": "Forwarded as it is, within the upstream's max_body_bytes: a "
            "JSON value, or any bytes with their own Content-Type.",
            "content": JSON_OR_ANY_BODY,
        },
        "responses": {
            "default": _upstream_answer(),
            **problems_by_status(),
        },
    }


def _write_parameters() -> list[dict[str, Any]]:
    """A fenced write's path parameters and the headers a worker sends."""
    return [
        {
            "name": "upstream",
            "in": "path",
            "required": True,
            "schema": HEADER,
            "description": "An [[upstreams]] name.",
        },
        {
            "name": "path",
            "in": "path",
            "required": True,
            "schema": HEADER,
            "description": "The rest of the path, appended to the upstream's URL; it may "
            "hold slashes, sent as they are or percent-encoded (%2F, as a generated "
            "client encodes a path parameter): the gateway forwards an encoded slash as "
            "a slash. Dot-segments (., .., encoded or not) are refused.",
        },
        {
            "name": protocol.FENCING_TOKEN,
            "in": "header",
            "required": True,
            "schema": HEADER,
            "description": "The lease token (fgl_...), or <source>:<token> of a "
            "[[lease_sources]] entry. A credential: never forwarded, never logged whole.",
        },
        {
            "name": protocol.IDEMPOTENCY_KEY,
            "in": "header",
            "required": False,
            "schema": KEY,
            "description": "Required where the upstream says so (the default). Keys "
            "belong to the job, across generations. " + KEY_RULE,
        },
        {
            "name": "Prefer",
            "in": "header",
            "required": False,
            "schema": {"type": "string", "pattern": "wait=[0-9]+"},
            "description": "wait=N (RFC 7240): a duplicate whose key is in flight waits up "
            "to N seconds (capped by gateway.max_prefer_wait_seconds) for its answer.",
        },
    ]


def _upstream_answer() -> dict[str, Any]:
    """The answer that is not the gateway's own: the upstream's, or its replay."""
    return {
        "description": "The upstream's answer, passed through; or a stored answer "
        "replayed to a duplicate.",
        "headers": {
            protocol.IDEMPOTENT_REPLAYED: {
                "description": "true: a stored answer; the upstream was not called.",
                "schema": {"type": "string", "enum": ["true"]},
            },
            "Preference-Applied": {
                "description": "wait=N: the duplicate waited for its key's answer.",
                "schema": HEADER,
            },
        },
        "content": UPSTREAM_ANSWER,
    }


def proxy_paths() -> dict[str, Any]:
    item: dict[str, Any] = {
        "summary": "Fenced writes (proxy listener)",
        "servers": [
            {
                "url": "http://{proxy}",
                "description": "The proxy listener (proxy_listen).",
                "variables": {"proxy": {"default": "127.0.0.1:8080"}},
            }
        ],
        "x-listener": "proxy",
    }
    item.update({method: fenced_write(method) for method in FENCED_METHODS})
    return {PROXY_PATH: item}


def proxy_webhooks() -> dict[str, Any]:
    """What reaches the upstream: the worker's request without Fencing-Token and the
    hop-by-hop headers, with the key and the fencing facts."""
    return {
        "forwarded-write": {
            method: {
                "operationId": f"upstream_{method}",
                "tags": ["proxy"],
                "summary": "A fenced write as it reaches the upstream",
                "description": "Sent by the gateway to the upstream's base URL + /{path}. "
                "Per-upstream headers from the config (set_headers, the profile's dedup "
                "key, an S3 signature) are set by the gateway.",
                "parameters": [
                    {
                        "name": protocol.IDEMPOTENCY_KEY,
                        "in": "header",
                        "schema": HEADER,
                        "description": "The worker's key, in one canonical form.",
                    },
                    {
                        "name": "Fencing-Job",
                        "in": "header",
                        "required": True,
                        "schema": HEADER,
                        "description": "The job the lease is for.",
                    },
                    {
                        "name": "Fencing-Generation",
                        "in": "header",
                        "required": True,
                        "schema": {"type": "string", "pattern": "^[0-9]+$"},
                        "description": "The lease's generation: an upstream that checks "
                        "fencing itself refuses a lower one than it has seen.",
                    },
                ],
                "requestBody": {"content": JSON_OR_ANY_BODY},
                "responses": {"default": {"description": "Passed back to the worker."}},
            }
            for method in FENCED_METHODS
        }
    }
