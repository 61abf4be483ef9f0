"""Fencing for boto3: an S3 client whose writes go through the gateway, fenced.

.. code-block:: python

    from fencegate_client.boto3 import fenced_s3_client

    s3 = fenced_s3_client(gateway_url="http://127.0.0.1:8080", upstream="files")
    with client.claim("exports", owner="worker-1") as lease:   # fencegate_client.sync
        with lease.step("upload-report"):
            s3.put_object(Bucket="reports", Key="2024/07.csv", Body=b"...")

The client's ``endpoint_url`` is the gateway's route to the upstream
(``{gateway_url}/{upstream}``), with path-style addressing (the bucket is the first path
segment). Two botocore event hooks fence it: ``before-send`` adds the lease's
``Fencing-Token`` and the current ``lease.step(name)`` block's ``Idempotency-Key`` to
every request that goes to the gateway, and ``before-parse`` turns a refusal of the
gateway that says the lease is gone (``stale-generation``, ``lease-expired``,
``lease-ended``) into the lease's ``LeaseLost`` error, raised from the call instead of a
``ClientError``. The lease is the one given (``lease=``), else the current one: the lease
whose ``with`` block is running.

A body sent after ``Expect: 100-continue`` (botocore does that for file-like bodies) is
refused before it is sent when the lease is gone; the gateway then closes that
connection, and botocore opens another for the next request. The client sends requests
unsigned by default: the worker holds no S3 credentials; the
gateway sets the upstream's (see the ``s3`` upstream profile). Pass ``config=`` (merged
over these defaults) to sign anyway. Needs the ``boto3`` extra.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._needs import needs

try:
    import boto3
    from botocore import UNSIGNED
    from botocore.awsrequest import AWSPreparedRequest
    from botocore.config import Config
except ModuleNotFoundError as error:
    for library in ("boto3", "botocore"):
        needs(error, __name__, library, install="'fencegate-client[boto3]'")
    raise

from .protocol import IDEMPOTENCY_KEY, LeaseState, fence_for, to_gateway

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client


def fenced_s3_client(
    *,
    gateway_url: str,
    upstream: str,
    lease: LeaseState | None = None,
    session: boto3.Session | None = None,
    config: Config | None = None,
    region_name: str = "us-east-1",
    **client_args: Any,
) -> S3Client:
    """An S3 client that writes through the gateway's ``upstream``, fenced by ``lease``
    (else the current lease). ``client_args`` go to ``session.client("s3", ...)``."""
    base = Config(
        signature_version=UNSIGNED,
        s3={"addressing_style": "path"},
        # No checksum trailers (aws-chunked bodies) unless an operation requires them:
        # the gateway fingerprints and forwards the body as sent.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    endpoint_url = f"{gateway_url.rstrip('/')}/{upstream}"
    client = (session or boto3.Session()).client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=region_name,
        config=base.merge(config) if config is not None else base,
        **client_args,
    )
    fence_s3(client, gateway_url=endpoint_url, lease=lease)
    return client


def fence_s3(client: S3Client, *, gateway_url: str, lease: LeaseState | None = None) -> None:
    """Register the fencing hooks on an S3 client whose endpoint is the gateway."""

    def before_send(request: AWSPreparedRequest, **_: Any) -> None:
        fencing = fence_for(lease)
        if fencing is None or not to_gateway(request.url, gateway_url):
            return
        has_key = IDEMPOTENCY_KEY in request.headers
        for name, value in fencing.fencing_headers(has_key=has_key).items():
            if name in request.headers:
                del request.headers[name]  # botocore's headers add, never replace
            request.headers[name] = value

    def before_parse(response_dict: dict[str, Any], **_: Any) -> None:
        fencing = fence_for(lease)
        if fencing is None:
            return
        body = response_dict.get("body")
        headers = response_dict.get("headers") or {}
        if isinstance(body, bytes):
            fencing.settle(
                int(response_dict["status_code"]), str(headers.get("Content-Type", "")), body
            )

    events = client.meta.events
    events.register("before-send.s3", before_send, unique_id=f"fencegate-send-{id(client)}")
    events.register("before-parse.s3", before_parse, unique_id=f"fencegate-parse-{id(client)}")
