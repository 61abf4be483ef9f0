"""S3 upstreams (``profile = "s3"``): the gateway's own signature and the fencing metadata.

Workers hold no bucket credentials (docs/limits.md), but S3 takes only signed requests.
So the gateway drops whatever signature a worker sent and signs each request it forwards
with its own credentials (``[upstreams.signing]``), with AWS Signature Version 4 through
botocore's signer (``S3SigV4Auth``: never a hand-written one). Object writes are first
stamped with ``x-amz-meta-fencing-job``, ``-generation`` and ``-key``, so an unknown
outcome can be settled by reading the object's metadata back (``gateway.proxy.resolve``).
"""

from __future__ import annotations

from typing import Final
from urllib.parse import parse_qsl, quote

from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from multidict import CIMultiDict

from gateway.config import SigningSettings

# A worker's own signature (or presigning) headers: never forwarded.
WORKER_SIGNATURE: Final = frozenset(
    {"authorization", "x-amz-date", "x-amz-security-token", "x-amz-content-sha256"}
)
META_JOB: Final = "x-amz-meta-fencing-job"
META_GENERATION: Final = "x-amz-meta-fencing-generation"
META_KEY: Final = "x-amz-meta-fencing-key"


def is_object_write(method: str, rest: str, query: str) -> bool:
    """PutObject (and CopyObject): ``PUT /{bucket}/{key}`` without a sub-resource query
    (a part upload, tagging, an ACL ... carry no object metadata)."""
    bucket, _, key = rest.partition("/")
    return method == "PUT" and bool(bucket) and bool(key) and not parse_qsl(query, True)


def drop_metadata(headers: CIMultiDict[str]) -> None:
    """A worker's own fencing metadata: never forwarded (only the gateway stamps it)."""
    for name in (META_JOB, META_GENERATION, META_KEY):
        headers.popall(name, None)


def stamp(headers: CIMultiDict[str], job_id: str, generation: int, upstream_key: str) -> None:
    """The fencing metadata of an object write (ASCII: the job id percent-encoded)."""
    headers[META_JOB] = quote(job_id, safe="/:-_.~")
    headers[META_GENERATION] = str(generation)
    headers[META_KEY] = upstream_key


def sign(
    headers: CIMultiDict[str], method: str, url: str, body: bytes, signing: SigningSettings
) -> None:
    """Replace any signature in ``headers`` with the gateway's own (SigV4 for S3, by
    botocore): ``Authorization``, ``X-Amz-Date`` and ``X-Amz-Content-SHA256`` (and
    ``X-Amz-Security-Token`` with a session token). Every header in ``headers`` is
    signed, so the request must be sent with exactly these."""
    for name in WORKER_SIGNATURE:
        headers.popall(name, None)
    token = signing.session_token.get_secret_value() if signing.session_token else None
    credentials = Credentials(
        signing.access_key_id.get_secret_value(),
        signing.secret_access_key.get_secret_value(),
        token,
    )
    request = AWSRequest(method=method, url=url, data=body, headers=dict(headers.items()))
    S3SigV4Auth(credentials, "s3", signing.region).add_auth(request)
    for name, value in request.headers.items():
        if name.lower() in WORKER_SIGNATURE:
            headers[name] = value if isinstance(value, str) else value.decode("ascii")
