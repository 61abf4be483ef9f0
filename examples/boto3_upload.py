#!/usr/bin/env python3
"""S3 writes through the gateway with boto3 (needs ``fencegate[boto3]``).

Takes the lease on job JOB_ID and uploads its report with an S3 client made by
``fenced_s3_client``: its endpoint is the gateway's ``files`` upstream, it holds no S3
credentials, and inside the lease's block and a ``lease.step(...)`` block every request
carries the lease's ``Fencing-Token`` and the step's ``Idempotency-Key``. Exit 3 when
the lease is lost.

    CONTROL_URL=... GATEWAY_URL=... python examples/boto3_upload.py JOB_ID
"""

from __future__ import annotations

import os
import sys

from fencegate_client import LeaseLost
from fencegate_client.boto3 import fenced_s3_client
from fencegate_client.sync import LeaseClient


def main(job_id: str) -> int:
    s3 = fenced_s3_client(
        gateway_url=os.environ.get("GATEWAY_URL", "http://127.0.0.1:8080"), upstream="files"
    )
    control = os.environ.get("CONTROL_URL", "http://127.0.0.1:8081")
    with LeaseClient(control, token=os.environ.get("WORKER_TOKEN")) as client:
        try:
            with client.acquire(job_id, owner="report-uploader", ttl=30) as lease:
                assert lease is not None  # acquire always answers a lease (or raises)
                with lease.step("upload-report"):
                    put = s3.put_object(
                        Bucket="reports", Key=f"{job_id}.csv", Body=b"customer,amount\n42,500\n"
                    )
                lease.complete({"etag": put.get("ETag")})
        except LeaseLost as lost:
            print(f"lease lost ({lost.reason}): stopping", file=sys.stderr)
            return 3
    print(f"job {job_id} completed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
