"""A fenced lock item in DynamoDB (a ``kind = "dynamodb"`` lease source), with boto3.

The table's partition key is ``lock_key`` (a string). A lock item carries ``fence`` (a
number: the generation, raised at every acquisition, never lowered), ``record_version``
(32 random hex digits written at every acquisition, as AWS's DynamoDB Lock Client writes
its ``recordVersionNumber``: it names this holding), ``holder`` (who holds it) and
``expires_at`` (seconds since the epoch) while it is held. Acquiring is one conditional
update: ``fence = if_not_exists(fence, 0) + 1`` when the item is free (no ``expires_at``)
or expired. Release removes ``holder`` and ``expires_at`` and keeps the item: deleting it
(or a DynamoDB TTL on it) would start its fence again at 1, and the gateway would then
refuse the new holders of the generations that already wrote (``generation-reissued``).

The worker sends ``Fencing-Token: <source>:<table>/<lock key>:<fence>.<record
version>``; the gateway reads the item (a consistent read): the same fence and record
version, held and not expired, is current.

.. code-block:: python

    import boto3
    from fencegate_client.dynamodb_lock import DynamoDbLock

    with DynamoDbLock(boto3.client("dynamodb"), "locks", "order-42", ttl_seconds=30) as lock:
        headers = {"Fencing-Token": lock.token, "Idempotency-Key": "charge"}
"""

from __future__ import annotations

import secrets
import time
from types import TracebackType
from typing import Any

from .errors import LeaseHeld

try:
    import boto3  # noqa: F401  (the client passed in is boto3's)
    from botocore.exceptions import ClientError
except ModuleNotFoundError as error:
    from ._needs import needs

    needs(error, __name__, "boto3", install="'fencegate-client[dynamodb]'")
    raise

NAMES = {"#f": "fence", "#h": "holder", "#e": "expires_at", "#v": "record_version"}


class DynamoDbLock:
    """One lock item of ``table``; a context manager that acquires (``LeaseHeld`` when it
    is held and not expired) and releases. Expiry is judged by the acquiring worker's
    clock here, by the gateway's database's clock at the gateway: keep clocks in sync."""

    def __init__(
        self,
        client: Any,
        table: str,
        key: str,
        *,
        ttl_seconds: float,
        source: str = "ddb",
        holder: str | None = None,
    ) -> None:
        if not key or not key.isprintable():
            raise ValueError("the lock key must be printable and not empty")
        if not 0 < ttl_seconds <= 86_400:
            raise ValueError("ttl_seconds must be above 0 and at most 86400")
        self.client, self.table, self.key = client, table, key
        self.ttl_seconds, self.source = ttl_seconds, source
        self.holder = holder or secrets.token_hex(8)
        self.fence: int | None = None
        self.record_version: str | None = None

    @property
    def token(self) -> str:
        """``Fencing-Token`` for writes under this holding."""
        assert self.fence is not None, "the lock is not held"
        return f"{self.source}:{self.table}/{self.key}:{self.fence}.{self.record_version}"

    def acquire(self) -> bool:
        """True when the lock is now this object's (``fence``, ``token``)."""
        now = time.time()
        version = secrets.token_hex(16)
        try:
            answer = self.client.update_item(
                TableName=self.table,
                Key={"lock_key": {"S": self.key}},
                UpdateExpression=(
                    "SET #f = if_not_exists(#f, :zero) + :one, #h = :h, #e = :e, #v = :v"
                ),
                ConditionExpression="attribute_not_exists(#e) OR #e <= :now",
                ExpressionAttributeNames=NAMES,
                ExpressionAttributeValues={
                    ":zero": {"N": "0"},
                    ":one": {"N": "1"},
                    ":h": {"S": self.holder},
                    ":e": {"N": repr(now + self.ttl_seconds)},
                    ":v": {"S": version},
                    ":now": {"N": repr(now)},
                },
                ReturnValues="UPDATED_NEW",
            )
        except ClientError as error:
            if _failed_condition(error):
                return False
            raise
        self.fence = int(answer["Attributes"]["fence"]["N"])
        self.record_version = version
        return True

    def extend(self, ttl_seconds: float | None = None) -> bool:
        """A new expiry, if the lock is still ours and not expired (False: lost)."""
        now = time.time()
        return self._update(
            "SET #e = :e",
            "#f = :f AND #v = :v AND #h = :h AND #e > :now",
            {":e": {"N": repr(now + (ttl_seconds or self.ttl_seconds))}, ":now": {"N": repr(now)}},
        )

    def release(self) -> bool:
        """Free the lock (its fence stays); the token is refused from then on."""
        if self.fence is None:
            return False
        return self._update("REMOVE #h, #e", "#f = :f AND #v = :v AND #h = :h", {})

    def _update(self, expression: str, condition: str, values: dict[str, Any]) -> bool:
        assert self.fence is not None, "the lock is not held"
        try:
            self.client.update_item(
                TableName=self.table,
                Key={"lock_key": {"S": self.key}},
                UpdateExpression=expression,
                ConditionExpression=condition,
                ExpressionAttributeNames=NAMES,
                ExpressionAttributeValues={
                    ":f": {"N": str(self.fence)},
                    ":v": {"S": str(self.record_version)},
                    ":h": {"S": self.holder},
                    **values,
                },
            )
        except ClientError as error:
            if _failed_condition(error):
                return False
            raise
        return True

    def __enter__(self) -> DynamoDbLock:
        if not self.acquire():
            raise LeaseHeld(f"the lock {self.key!r} of {self.table} is held")
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def _failed_condition(error: ClientError) -> bool:
    return bool(error.response.get("Error", {}).get("Code") == "ConditionalCheckFailedException")


def create_table(client: Any, table: str) -> None:
    """The lock table (on demand), for tests and first setups; infrastructure code
    usually owns it: partition key ``lock_key``, a string, and nothing else."""
    client.create_table(
        TableName=table,
        AttributeDefinitions=[{"AttributeName": "lock_key", "AttributeType": "S"}],
        KeySchema=[{"AttributeName": "lock_key", "KeyType": "HASH"}],
        BillingMode="PAY_PER_REQUEST",
    )
    client.get_waiter("table_exists").wait(TableName=table)
