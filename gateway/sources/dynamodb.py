"""``dynamodb``: a lock item whose ``fence`` is raised by a conditional update at every
acquisition (``fencegate_client.dynamodb_lock``), which also writes a random
``record_version`` (as AWS's DynamoDB Lock Client does with its
``recordVersionNumber``). The token is ``<table>/<lock key>:<fence>.<record version>``;
the job is ``<table>/<lock key>``, the generation the fence, the holder the record
version (a lock item deleted and acquired again starts at fence 1 with another). The gateway
reads the item with a consistent read through botocore (its own credentials, botocore's
default chain), the call run in a worker thread so the event loop never blocks; the
item's ``expires_at`` is judged by the admission with the database's clock. Nothing is
cached.

At start the credentials are resolved once (``credentials_problem``): when botocore's
chain finds none, ``serve`` stops with a message that says where it looked, instead of
every check answering 503 later."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import botocore.session
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from gateway.config import DynamoDbSourceSettings
from gateway.fencing.fence import Lost
from gateway.sources.base import ExternalLease, log, namespaced
from gateway.sources.secured import SourceRefused
from lease_core import exceptions as lease_exc

# DynamoDB's numbers have 38 digits: a fence past the database's integer is read, then
# refused at intake with the limit named (``bounded``).
FENCE = re.compile(r"[1-9][0-9]{0,37}")
VERSION = re.compile(r"[0-9a-f]{32}")

COUNTER_LOST = (
    "DynamoDB says this lock item is held with this fence, but a higher generation of "
    "this job has already written, or another holder of the item already wrote under "
    "this fence: the item's fence went backwards (the item was deleted, "
    "expired by a DynamoDB TTL, or the table restored from a backup). Never delete lock "
    "items nor put a TTL on them; raise the item's fence past highest_generation and "
    "acquire again."
)


class DynamoDbSource:
    def __init__(self, settings: DynamoDbSourceSettings) -> None:
        self.name = settings.name
        self.settings = settings
        self.client: Any = None

    def well_formed(self, token: str) -> bool:
        item, colon, held = token.rpartition(":")
        table, slash, key = item.partition("/")
        fence, dot, version = held.partition(".")
        return (
            bool(colon and slash and table and key and dot)
            and len(token) <= 1024
            and FENCE.fullmatch(fence) is not None
            and VERSION.fullmatch(version) is not None
            and token.isprintable()
        )

    async def start(self) -> None:
        timeout = self.settings.timeout_seconds
        config = Config(
            connect_timeout=timeout, read_timeout=timeout, retries={"total_max_attempts": 1}
        )
        session = botocore.session.get_session()
        problem = await asyncio.to_thread(credentials_problem, session)
        if problem is not None:
            raise SourceRefused(f"lease source {self.name}: {problem}")
        self.client = session.create_client(
            "dynamodb",
            region_name=self.settings.region,
            endpoint_url=self.settings.endpoint_url,
            config=config,
        )

    async def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            client.close()

    async def check(self, token: str) -> ExternalLease | None:
        item_name, _, held_text = token.rpartition(":")
        fence_text, _, version = held_text.partition(".")
        table, _, key = item_name.partition("/")
        job_id = namespaced(self.name, item_name)
        if table != self.settings.table or job_id is None:
            return None  # only the configured table is read
        fence = int(fence_text)
        item = await self._read(key)
        held = _number(item.get("fence"))
        if held is None or held < fence:
            return None  # never granted this fence
        owner = item.get("holder", {}).get("S", "")[:200]
        if held > fence:  # somebody acquired it since
            return ExternalLease(self.name, job_id, fence, owner, Lost.NEWER_HOLDER, newer=held)
        expires_at = _number(item.get("expires_at"))
        if expires_at is None or item.get("record_version", {}).get("S") != version:
            # Released; or this fence is another holding's now (the item was deleted and
            # acquired again): either way this holding has ended.
            return ExternalLease(self.name, job_id, fence, owner, Lost.RELEASED)
        return ExternalLease(
            self.name,
            job_id,
            fence,
            owner,
            expires_at=expires_at,
            holder=version,
            counter_lost=COUNTER_LOST,
            reissued=COUNTER_LOST,
        )

    async def _read(self, key: str) -> dict[str, Any]:
        """The lock item's attributes ({} when there is none); DynamoDB unreachable or
        refusing: 503, as for the database."""
        assert self.client is not None, "the source was not started"
        try:
            answer = await asyncio.to_thread(
                self.client.get_item,
                TableName=self.settings.table,
                Key={"lock_key": {"S": key}},
                ConsistentRead=True,
                ProjectionExpression="#f, #h, #e, #v",
                ExpressionAttributeNames={
                    "#f": "fence",
                    "#h": "holder",
                    "#e": "expires_at",
                    "#v": "record_version",
                },
            )
        except (BotoCoreError, ClientError) as error:
            log.warning("%s: DynamoDB did not answer: %s", self.name, error)
            raise lease_exc.StoreUnavailable(
                f"lease source {self.name}: DynamoDB did not answer"
            ) from error
        item: dict[str, Any] = answer.get("Item") or {}
        return item


NO_CREDENTIALS = (
    "botocore found no AWS credentials for DynamoDB. It looked at "
    "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a web identity token "
    "(AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN), the profile AWS_PROFILE (else "
    "default) of the shared credentials and config files (AWS_SHARED_CREDENTIALS_FILE, "
    "AWS_CONFIG_FILE; ~/.aws/credentials, ~/.aws/config), the container's credentials "
    "(AWS_CONTAINER_CREDENTIALS_RELATIVE_URI or _FULL_URI) and the EC2 instance "
    "metadata service (unless AWS_EC2_METADATA_DISABLED=true). Give the gateway's process "
    "one of them"
)


def credentials_problem(session: Any = None) -> str | None:
    """None when botocore's default chain finds credentials; else what it lacks. Blocking
    (it may ask the instance metadata service): run it in a thread."""
    session = session or botocore.session.get_session()
    try:
        credentials = session.get_credentials()
    except BotoCoreError as error:
        return f"botocore could not read the AWS credentials: {error}"
    return NO_CREDENTIALS if credentials is None else None


def _number(value: Any) -> Any:
    """An attribute of type N as an int (the fence) or a float (the expiry)."""
    if not isinstance(value, dict) or "N" not in value:
        return None
    text = value["N"]
    try:
        return int(text) if text.isdigit() else float(text)
    except ValueError:
        return None
