"""``profile = "s3"`` against a real S3-compatible server (moto's server mode, run as a
process, with signature checking on): the worker's boto3 client holds no credentials and
sends unsigned requests; the gateway signs them with its own (SigV4, botocore's signer)
and stamps the fencing metadata on object writes. On SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import boto3
import pytest
from aiohttp import web
from botocore import UNSIGNED
from botocore.config import Config

from gateway.fencing.profiles import upstream_key
from gateway.proxy.gateway import Gateway
from gateway.service.admin import GATEWAY_STATE
from tests.gateway_helpers import problem
from tests.support import FakeClock, free_port

ACCESS_KEY = "gateway-only"


@pytest.fixture(scope="module")
def moto() -> Iterator[dict[str, str]]:
    """A moto server on a free port; after the first four (unauthenticated) calls that
    create the gateway's IAM user, its key, its policy and the bucket, every request's
    signature is checked."""
    port = free_port()
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "4", "AWS_DEFAULT_REGION": "us-east-1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{url}/moto-api/", timeout=1)
                break
            except OSError:
                assert time.monotonic() < deadline, "moto did not start"
                assert process.poll() is None, "moto exited"
                time.sleep(0.1)
        admin = {"endpoint_url": url, "region_name": "us-east-1"}
        creds = {"aws_access_key_id": "bootstrap", "aws_secret_access_key": "bootstrap"}
        iam = boto3.client("iam", **admin, **creds)
        iam.create_user(UserName="gateway")
        key = iam.create_access_key(UserName="gateway")["AccessKey"]
        iam.put_user_policy(
            UserName="gateway",
            PolicyName="all-s3",
            PolicyDocument='{"Version": "2012-10-17", "Statement": [{"Effect": "Allow",'
            ' "Action": "s3:*", "Resource": "*"}]}',
        )
        boto3.client("s3", **admin, **creds).create_bucket(Bucket="reports")
        yield {"url": url, "id": key["AccessKeyId"], "secret": key["SecretAccessKey"]}
    finally:
        process.terminate()
        process.wait(10)


def s3_upstream(moto: dict[str, str], **extra: Any) -> dict[str, Any]:
    return {
        "name": "files",
        "url": moto["url"],
        "profile": "s3",
        "signing": {"access_key_id": moto["id"], "secret_access_key": moto["secret"]},
        **extra,
    }


def gateway_client(stack: Any) -> Any:
    """The worker's S3 client: unsigned, path-style, through the gateway."""
    return boto3.client(
        "s3",
        endpoint_url=str(stack.proxy.make_url("/files")),
        region_name="us-east-1",
        config=Config(signature_version=UNSIGNED, s3={"addressing_style": "path"}),
    )


def direct_client(moto: dict[str, str]) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=moto["url"],
        region_name="us-east-1",
        aws_access_key_id=moto["id"],
        aws_secret_access_key=moto["secret"],
    )


def fenced(s3: Any, lease: dict[str, Any], key: str | None) -> None:
    def add(request: Any, **_: Any) -> None:
        request.headers["Fencing-Token"] = lease["lease_token"]
        if key is not None:
            request.headers["Idempotency-Key"] = key

    s3.meta.events.register("before-send.s3.*", add)


async def test_the_gateway_signs_and_stamps_object_writes(
    make_stack: Callable[..., Any], moto: dict[str, str]
) -> None:
    stack = await make_stack(upstreams=[s3_upstream(moto)], use_clock=False)
    lease = await stack.lease("export-1")
    s3 = gateway_client(stack)
    fenced(s3, lease, "report-2024-07")

    def work() -> dict[str, Any]:
        s3.put_object(Bucket="reports", Key="2024/07.csv", Body=b"a,b\n1,2\n")
        head: dict[str, Any] = direct_client(moto).head_object(Bucket="reports", Key="2024/07.csv")
        return head

    head = await asyncio.to_thread(work)
    assert head["Metadata"] == {
        "fencing-job": "export-1",
        "fencing-generation": str(lease["generation"]),
        "fencing-key": upstream_key("export-1", "report-2024-07"),
    }
    # Reads pass through, signed by the gateway too.
    got = await asyncio.to_thread(
        lambda: s3.get_object(Bucket="reports", Key="2024/07.csv")["Body"].read()
    )
    assert got == b"a,b\n1,2\n"


async def test_moto_checks_the_signature(
    make_stack: Callable[..., Any], moto: dict[str, str]
) -> None:
    wrong = {**moto, "secret": "not-the-secret-of-this-key"}
    stack = await make_stack(upstreams=[s3_upstream(wrong)], use_clock=False)
    lease = await stack.lease("export-2")
    resp = await stack.write(
        "/files/reports/x.csv", lease, key="x", method="PUT", headers={"Authorization": "x"}
    )
    assert resp.status == 403
    assert b"SignatureDoesNotMatch" in await resp.read()


async def test_a_workers_signature_and_metadata_are_dropped(
    make_stack: Callable[..., Any], moto: dict[str, str]
) -> None:
    stack = await make_stack(upstreams=[s3_upstream(moto)], use_clock=False)
    lease = await stack.lease("export-3")
    forged = {
        "Authorization": "AWS4-HMAC-SHA256 Credential=worker/20260101/us-east-1/s3/aws4_request,"
        " SignedHeaders=host, Signature=00",
        "X-Amz-Date": "20260101T000000Z",
        "x-amz-meta-fencing-generation": "999",
    }
    resp = await stack.write("/files/reports/y.csv", lease, key="y", method="PUT", headers=forged)
    assert resp.status == 200, await resp.read()
    head = await asyncio.to_thread(
        lambda: direct_client(moto).head_object(Bucket="reports", Key="y.csv")
    )
    assert head["Metadata"]["fencing-generation"] == str(lease["generation"])
    stale = await stack.lease("export-3")
    assert stale["generation"] > lease["generation"]
    await problem(
        await stack.write("/files/reports/y.csv", lease, key="y2", method="PUT"),
        409,
        "stale-generation",
    )


# -- unknown outcomes of object writes, resolved by their metadata -----------------------


class Cutter:
    """A real HTTP hop in front of moto. ``mode`` for the next write: ``"after"`` passes
    it on and cuts the connection instead of relaying the answer (the object is stored;
    the gateway never learns it), ``"before"`` cuts it without passing it on."""

    def __init__(self, moto_url: str) -> None:
        self.moto_url = moto_url
        self.mode: str | None = None
        self.seen: list[tuple[str, dict[str, str]]] = []
        self.url = ""
        # Run (in a thread) once a HEAD's answer is in: someone else's write in between.
        self.after_head: Callable[[], Any] | None = None

    async def handler(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.seen.append((request.method, dict(request.headers)))
        mode = self.mode if request.method == "PUT" else None
        if mode is not None:
            self.mode = None
        if mode != "before":
            headers = {
                k: v
                for k, v in request.headers.items()
                if k.lower() not in ("content-length", "transfer-encoding", "connection")
            }
            async with aiohttp.ClientSession(auto_decompress=False) as session:
                async with session.request(
                    request.method,
                    self.moto_url + request.path_qs,
                    headers=headers,
                    data=body,
                    skip_auto_headers=("Content-Type", "User-Agent", "Accept-Encoding"),
                ) as answer:
                    status, content = answer.status, await answer.read()
                    answer_headers = {
                        k: v
                        for k, v in answer.headers.items()
                        if k.lower()
                        not in ("content-length", "transfer-encoding", "connection", "date")
                    }
        if mode is not None:
            assert request.transport is not None
            request.transport.close()
            raise asyncio.CancelledError
        if request.method == "HEAD" and self.after_head is not None:
            await asyncio.to_thread(self.after_head)
        return web.Response(status=status, body=content, headers=answer_headers)


@pytest.fixture
async def cutter(aiohttp_server: Callable[..., Any], moto: dict[str, str]) -> Cutter:
    hop = Cutter(moto["url"])
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", hop.handler)
    server = await aiohttp_server(app)
    hop.url = str(server.make_url("")).rstrip("/")
    return hop


def versioned_bucket(moto: dict[str, str], name: str) -> None:
    direct = direct_client(moto)
    direct.create_bucket(Bucket=name)
    direct.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})


def versions(moto: dict[str, str], bucket: str, key: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = (
        direct_client(moto).list_object_versions(Bucket=bucket, Prefix=key).get("Versions", [])
    )
    return found


@pytest.mark.parametrize("cut", ["after", "before"])
async def test_an_object_write_with_a_lost_answer_is_resolved_by_its_metadata(
    make_stack: Callable[..., Any],
    moto: dict[str, str],
    cutter: Cutter,
    clock: FakeClock,
    cut: str,
) -> None:
    bucket = f"resolve-{cut}-{uuid.uuid4().hex[:8]}"
    await asyncio.to_thread(versioned_bucket, moto, bucket)
    upstream = s3_upstream({**moto, "url": cutter.url}, unknown_outcome="resolve")
    stack = await make_stack(upstreams=[upstream])
    lease = await stack.lease("export-9")
    cutter.mode = cut
    path = f"/files/{bucket}/2024/07.csv"
    resp = await stack.write(path, lease, key="report", method="PUT")
    assert resp.status == 502
    stored = await asyncio.to_thread(versions, moto, bucket, "2024/07.csv")
    assert len(stored) == (1 if cut == "after" else 0)
    resp = await stack.control.get("/admin/unknown-outcomes")
    [held] = (await resp.json())["items"]
    assert held["resolvable"] is True

    clock.advance(2)
    gateway: Gateway = stack.control.app[GATEWAY_STATE]
    assert await gateway.resolver.run_once() == 1
    methods = [method for method, _ in cutter.seen]
    if cut == "after":
        assert methods == ["PUT", "HEAD"]  # written by this write: not sent again
    else:
        assert methods == ["PUT", "HEAD", "PUT"]
        assert cutter.seen[-1][1]["If-None-Match"] == "*"  # a create, only once
    assert len(await asyncio.to_thread(versions, moto, bucket, "2024/07.csv")) == 1
    head = await asyncio.to_thread(
        lambda: direct_client(moto).head_object(Bucket=bucket, Key="2024/07.csv")
    )
    assert head["Metadata"]["fencing-key"] == upstream_key("export-9", "report")
    # The worker's retry gets the stored answer; the audit says who resolved it.
    again = await stack.write(path, lease, key="report", method="PUT")
    assert again.status == 200 and again.headers["Idempotent-Replayed"] == "true"
    assert again.headers["ETag"] == head["ETag"]
    [entry] = await stack.audit(reason="auto-resolved")
    assert entry["job_id"] == "export-9" and entry["status"] == 200
    assert len(cutter.seen) == (2 if cut == "after" else 3)


async def test_a_resolution_whose_object_changed_after_its_head_stays_unknown(
    make_stack: Callable[..., Any], moto: dict[str, str], cutter: Cutter, clock: FakeClock
) -> None:
    """The gateway's own precondition (``If-None-Match: *`` after a 404) is not met when
    someone creates the object between the HEAD and the re-send: S3's 412 leaves the
    record unknown, kept for the next round, and nothing is overwritten."""
    bucket = f"changed-{uuid.uuid4().hex[:8]}"
    await asyncio.to_thread(direct_client(moto).create_bucket, Bucket=bucket)
    upstream = s3_upstream({**moto, "url": cutter.url}, unknown_outcome="resolve")
    stack = await make_stack(upstreams=[upstream])
    lease = await stack.lease("export-10")
    cutter.mode = "before"  # lost before it reached S3: no object
    path = f"/files/{bucket}/2024/08.csv"
    resp = await stack.write(path, lease, key="report", method="PUT")
    assert resp.status == 502

    cutter.after_head = lambda: direct_client(moto).put_object(
        Bucket=bucket, Key="2024/08.csv", Body=b"someone else's"
    )
    clock.advance(2)
    gateway: Gateway = stack.control.app[GATEWAY_STATE]
    assert await gateway.resolver.run_once() == 0
    assert [method for method, _ in cutter.seen] == ["PUT", "HEAD", "PUT"]
    assert cutter.seen[-1][1]["If-None-Match"] == "*"
    got = await asyncio.to_thread(
        lambda: direct_client(moto).get_object(Bucket=bucket, Key="2024/08.csv")["Body"].read()
    )
    assert got == b"someone else's"
    resp = await stack.control.get("/admin/unknown-outcomes")
    [held] = (await resp.json())["items"]
    assert held["state"] == "unknown" and held["resolvable"] is True
    assert held["note"] == "re-sent; the object changed meanwhile (412)"
    assert await stack.audit(reason="auto-resolved") == []


async def test_a_create_only_once_is_refused_clearly_when_the_object_exists(
    make_stack: Callable[..., Any], moto: dict[str, str]
) -> None:
    """A step that must create its object only once sends ``If-None-Match: *``; when the
    object exists, S3's 412 becomes the gateway's ``precondition-failed`` (nothing was
    written). It is not the key's answer: the key stays free, so the same step may try
    again (and is refused again while the object exists)."""
    stack = await make_stack(upstreams=[s3_upstream(moto)], use_clock=False)
    lease = await stack.lease("export-once")
    s3 = gateway_client(stack)
    name = f"once-{uuid.uuid4().hex}.csv"  # moto lives as long as the module
    fenced(s3, lease, "create-1")
    await asyncio.to_thread(
        s3.put_object, Bucket="reports", Key=name, Body=b"first", IfNoneMatch="*"
    )
    for _ in range(2):
        resp = await stack.write(
            f"/files/reports/{name}",
            lease,
            key="create-2",
            method="PUT",
            headers={"If-None-Match": "*"},
        )
        doc = await problem(resp, 412, "precondition-failed")
        assert doc["job_id"] == "export-once" and "If-None-Match" in doc["detail"]
    got = await asyncio.to_thread(
        lambda: direct_client(moto).get_object(Bucket="reports", Key=name)["Body"].read()
    )
    assert got == b"first"
    reasons = [e["reason"] for e in await stack.audit(job_id="export-once")]
    assert reasons.count("precondition-failed") == 2
    # The worker's boto3 sees the refusal as an error, not as a success.
    fenced(s3, lease, "create-3")
    from botocore.exceptions import ClientError

    with pytest.raises(ClientError) as raised:
        await asyncio.to_thread(
            s3.put_object, Bucket="reports", Key=name, Body=b"again", IfNoneMatch="*"
        )
    assert raised.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
