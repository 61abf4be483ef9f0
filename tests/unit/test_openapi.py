"""The OpenAPI document: generated from the code (gateway/service/openapi.py), the same as
the copy in the repository, valid OpenAPI 3.1, and naming every route of the control
listener, every reason with its status, and nothing else."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openapi_spec_validator import validate

from fencegate_client import protocol
from fencegate_client.reasons import REASONS, Layer, Sent
from gateway.service import openapi
from gateway.service.openapi_proxy import PROXY_PATH


@pytest.fixture(scope="module")
def fresh() -> bytes:
    return openapi.generate()


@pytest.fixture(scope="module")
def doc(fresh: bytes) -> dict[str, Any]:
    parsed: dict[str, Any] = json.loads(fresh)
    return parsed


def test_the_committed_document_is_the_generated_one(fresh: bytes) -> None:
    assert openapi.COMMITTED.read_bytes() == fresh, (
        "docs/openapi.json is out of date: run python -m gateway.service.openapi"
    )


def test_it_is_valid_openapi_3_1(doc: dict[str, Any]) -> None:
    assert doc["openapi"] == "3.1.0"
    validate(doc)


async def test_every_route_of_the_control_app_is_an_operation_and_no_other(
    doc: dict[str, Any], tmp_path: Any
) -> None:
    from gateway.config import Settings
    from gateway.service.server import create_control_app
    from lease_core.db import create_engine
    from lease_core.store import LeaseStore

    engine = create_engine(f"sqlite+aiosqlite:///{tmp_path}/never-opened.db")
    try:
        app = create_control_app(Settings(), LeaseStore(engine))
        routes = {(method.lower(), path) for method, path in openapi.routes(app.router)}
    finally:
        await engine.dispose()
    control = {
        (method, path)
        for path, item in doc["paths"].items()
        if item.get("x-listener") != "proxy"
        for method in item
        if method in {"get", "put", "post", "delete", "patch", "head", "options"}
    }
    assert routes == control
    assert len(routes) >= 23
    # Every GET route also answers HEAD (aiohttp adds it): nothing else does.
    heads = {r.resource.canonical for r in app.router.routes() if r.method == "HEAD"}
    assert heads == {path for method, path in routes if method == "get"}


def test_a_route_without_an_operation_is_refused() -> None:
    from aiohttp import web

    async def handler(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_get("/v1/secret", handler)
    with pytest.raises(ValueError, match=r"routes with no operation.*'/v1/secret'"):
        openapi.document(app.router)


def test_every_reason_with_a_fixed_status_is_a_problem_type(doc: dict[str, Any]) -> None:
    schemas = doc["components"]["schemas"]
    for reason, info in REASONS.items():
        schema = schemas[f"Problem-{reason.value}"]
        assert schema["properties"]["status"] == {"const": info.status}
        assert schema["properties"]["reason"] == {"const": reason.value}
        assert schema["properties"]["type"] == {
            "const": f"https://fencegate.dev/problems/{reason.value}"
        }
        assert schema.get("x-retry-after", False) == info.retry_after


def test_each_gateway_problem_type_says_whether_the_write_was_sent(doc: dict[str, Any]) -> None:
    """A generated client reads ``sent`` from the document: each gateway reason's schema
    fixes it (``x-sent`` and the property's ``const``), the ``Problem`` schema names its
    values; a reason only the control listener answers has none."""
    schemas = doc["components"]["schemas"]
    member = schemas["Problem"]["properties"]["sent"]
    [values] = [branch for branch in member["anyOf"] if branch.get("type") == "string"]
    assert values["enum"] == [s.value for s in Sent]
    assert "never" in member["description"] and "new key" in member["description"]
    for reason, info in REASONS.items():
        schema = schemas[f"Problem-{reason.value}"]
        if info.sent is None:
            assert "x-sent" not in schema and "sent" not in schema["properties"], reason
            continue
        assert schema["x-sent"] == info.sent.value, reason
        assert schema["properties"]["sent"] == {"const": info.sent.value}, reason
    # The proxy's 504 is upstream-timeout alone: sent maybe, and never with Retry-After.
    timeout = doc["paths"][PROXY_PATH]["post"]["responses"]["504"]
    assert "headers" not in timeout and "sent maybe" in timeout["description"]


def test_the_proxy_answers_each_of_its_reasons_at_its_status(doc: dict[str, Any]) -> None:
    item = doc["paths"][PROXY_PATH]
    assert item["x-listener"] == "proxy" and item["servers"]
    for method in ("post", "put", "patch", "delete"):
        write = item[method]
        headers = {p["name"]: p for p in write["parameters"] if p["in"] == "header"}
        assert headers[protocol.FENCING_TOKEN]["required"] is True
        assert set(headers) == {protocol.FENCING_TOKEN, protocol.IDEMPOTENCY_KEY, "Prefer"}
        assert protocol.IDEMPOTENT_REPLAYED in write["responses"]["default"]["headers"]
        answered = set()
        for status, response in write["responses"].items():
            if status == "default":
                continue
            schema = response["content"]["application/problem+json"]["schema"]
            for ref in schema.get("oneOf", [schema]):
                reason = ref["$ref"].rsplit("/Problem-", 1)[1]
                assert doc["components"]["schemas"][f"Problem-{reason}"]["properties"][
                    "status"
                ] == {"const": int(status)}
                answered.add(reason)
        assert answered == {r.value for r, i in REASONS.items() if Layer.GATEWAY in i.layers}
    upstream = doc["webhooks"]["forwarded-write"]["post"]
    assert {p["name"] for p in upstream["parameters"]} == {
        protocol.IDEMPOTENCY_KEY,
        "Fencing-Job",
        "Fencing-Generation",
    }


def test_the_request_bodies_are_the_handlers_models(doc: dict[str, Any]) -> None:
    from gateway.service.admin import ResolveBody
    from lease_core import api

    schemas = doc["components"]["schemas"]
    for model in (api.AcquireBody, api.RenewBody, api.FailBody, ResolveBody):
        assert schemas[model.__name__] == openapi.request_schema(model)
        validated = model.model_json_schema(ref_template=openapi.REF, mode="validation")
        assert schemas[model.__name__]["required"] == validated["required"]
        assert schemas[model.__name__]["properties"].keys() == validated["properties"].keys()
    acquire = doc["paths"]["/v1/jobs/{job_id}/lease"]["put"]
    assert acquire["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/AcquireBody"
    }


def test_security_follows_the_token_check(doc: dict[str, Any]) -> None:
    from gateway.service.auth import OPEN_PATHS

    for path, item in doc["paths"].items():
        if item.get("x-listener") == "proxy":
            continue
        for method, op in item.items():
            names = {name for requirement in op["security"] for name in requirement}
            if path in OPEN_PATHS:
                assert names == set(), (method, path)
            elif path.startswith("/v1/"):
                assert names == {"workerToken", "adminToken"}, path
            elif path == "/metrics":
                assert names == {"adminToken", "metricsToken"}
            elif path.startswith("/admin/ui/") and "{name}" in path:
                assert names == set()  # the two files of OPEN_PATHS
            else:
                assert names == {"adminToken"}, (method, path)


def test_optional_request_fields_carry_no_default(doc: dict[str, Any]) -> None:
    """openapi-typescript (defaultNonNullable, its default) types a property with a
    ``default`` as always present: every optional field of a request body would be
    required. The default is said in the description instead."""
    schemas = doc["components"]["schemas"]
    for model in openapi.REQUESTS:
        schema = schemas[model.__name__]
        for name, prop in schema["properties"].items():
            assert "default" not in prop, (model.__name__, name)
    enqueue = schemas["EnqueueBody"]
    assert "required" not in enqueue  # {queue, payload} is a whole request
    fail = schemas["FailBody"]["properties"]["retry_in_seconds"]
    assert fail["description"] == "Default: 0.0."


def test_a_proxy_write_takes_json_or_any_bytes(doc: dict[str, Any]) -> None:
    for method in ("post", "put", "patch", "delete"):
        body = doc["paths"][PROXY_PATH][method]["requestBody"]
        assert list(body["content"]) == ["application/json", "application/octet-stream"]
        schema = body["content"]["application/json"]["schema"]
        assert (schema["type"], schema["additionalProperties"]) == ("object", {})


def test_jobs_are_listed_oldest_first(doc: dict[str, Any]) -> None:
    assert doc["paths"]["/v1/jobs"]["get"]["summary"] == "List jobs, oldest first"
