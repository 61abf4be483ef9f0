"""Which job a fenced Celery task leases (``FencedTask.fence_job_id``) and what it
completes the job with: no broker, no worker, no lease service."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from fencegate_client.celery import FencedTask, _json_or_none, fenced

app = Celery("fencegate_unit", set_as_current=False)


@app.task(base=FencedTask, fence_job="order_id")
def by_argument(customer: str, order_id: str, amount: int = 0) -> None:
    """The job is named by the argument ``order_id``."""


@fenced(app, fence_job=lambda order_id, **_: f"order-{order_id}")
def by_function(order_id: str, note: str = "") -> None:
    """The job is computed from the arguments."""


@app.task(base=FencedTask)
def by_task_id() -> None:
    """The job is the task's id."""


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [(("cus_1", "o-42"), {}), (("cus_1",), {"order_id": "o-42"}), ((), {"order_id": "o-42"})],
)
def test_a_named_argument_is_found_positional_or_by_keyword(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    assert by_argument.fence_job_id(args, kwargs) == "o-42"


def test_a_missing_argument_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="fence_job names 'order_id'"):
        by_argument.fence_job_id(("cus_1",), {})


def test_a_function_computes_the_job_from_the_arguments() -> None:
    assert by_function.fence_job_id(("42",), {"note": "x"}) == "order-42"
    assert isinstance(by_function, FencedTask)


def test_the_default_job_is_the_task_id_and_a_direct_call_has_none() -> None:
    by_task_id.push_request(id="5d0f3c1e-task-id")
    try:
        assert by_task_id.fence_job_id((), {}) == "5d0f3c1e-task-id"
    finally:
        by_task_id.pop_request()
    with pytest.raises(ValueError, match="called directly"):
        by_task_id.fence_job_id((), {})


def test_a_result_that_is_not_json_completes_the_job_without_one() -> None:
    assert _json_or_none({"a": [1, "b"]}) == {"a": [1, "b"]}
    assert _json_or_none({1, 2}) is None
