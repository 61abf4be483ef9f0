"""The pure parts of the hot path (``lease_core.statement``, ``lease_core.coalesce``,
``lease_core.direct``): how a ``Statement`` becomes PostgreSQL's and SQLite's text, how
the ``Coalescer`` groups concurrent calls into batches, and which driver errors count as
"the database is not there"."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable

import pytest

from lease_core import exceptions as exc
from lease_core.coalesce import Coalescer
from lease_core.direct import is_unavailable
from lease_core.statement import Statement

SERVER_NOW = "CAST(extract(epoch FROM now()) AS double precision)"

# -- Statement --------------------------------------------------------------------------


def test_names_are_numbered_in_order_of_first_use() -> None:
    text, names = Statement("SELECT :b, :a FROM t WHERE x = :c").postgres(False)
    assert text == "SELECT $1, $2 FROM t WHERE x = $3"
    assert names == ("b", "a", "c")


def test_a_repeated_name_keeps_its_number() -> None:
    text, names = Statement("SELECT :a, :b, :a, (:b + :a), :c").postgres(False)
    assert text == "SELECT $1, $2, $1, ($2 + $1), $3"
    assert names == ("a", "b", "c")


def test_a_name_that_extends_another_is_its_own_parameter() -> None:
    text, names = Statement("SELECT :a, :ab, :a_1, :ab").postgres(False)
    assert text == "SELECT $1, $2, $3, $2"
    assert names == ("a", "ab", "a_1")


def test_casts_are_left_alone() -> None:
    text, names = Statement("SELECT :x::text, y::int, z :: bigint, CAST(:y AS text[])").postgres(
        False
    )
    assert text == "SELECT $1::text, y::int, z :: bigint, CAST($2 AS text[])"
    assert names == ("x", "y")


def test_colons_followed_by_digits_or_inside_words_are_not_parameters() -> None:
    text, names = Statement("SELECT '12:30', a:b, :p FROM t").postgres(False)
    assert text == "SELECT '12:30', a:b, $1 FROM t"
    assert names == ("p",)


def test_injected_now_is_a_numbered_double_precision_parameter() -> None:
    statement = Statement("UPDATE t SET at = {now} + :ttl WHERE id = :id AND at < {now}")
    text, names = statement.postgres(True)
    assert text == (
        "UPDATE t SET at = CAST($1 AS double precision) + $2 WHERE id = $3 "
        "AND at < CAST($1 AS double precision)"
    )
    assert names == ("now", "ttl", "id")


def test_server_now_is_postgres_own_clock_and_takes_no_parameter() -> None:
    statement = Statement("UPDATE t SET at = {now} + :ttl WHERE id = :id AND at < {now}")
    text, names = statement.postgres(False)
    assert text == (f"UPDATE t SET at = {SERVER_NOW} + $1 WHERE id = $2 AND at < {SERVER_NOW}")
    assert "extract(epoch FROM now())" in text
    assert names == ("ttl", "id")
    assert "$3" not in text


def test_the_two_postgres_variants_are_distinct_and_stable() -> None:
    statement = Statement("SELECT {now}, :a")
    assert statement.postgres(True) == ("SELECT CAST($1 AS double precision), $2", ("now", "a"))
    assert statement.postgres(False) == (f"SELECT {SERVER_NOW}, $1", ("a",))
    # Asked again (cached): the same answers.
    assert statement.postgres(True) == ("SELECT CAST($1 AS double precision), $2", ("now", "a"))
    assert statement.postgres(False) == (f"SELECT {SERVER_NOW}, $1", ("a",))


def test_sqlite_text_keeps_names_and_makes_now_a_parameter() -> None:
    statement = Statement("SELECT {now} + :ttl, :a, :a::text FROM t WHERE at < {now}")
    assert statement.sqlite == "SELECT :now + :ttl, :a, :a::text FROM t WHERE at < :now"


def test_the_original_text_is_kept() -> None:
    raw = "SELECT {now}, :a"
    statement = Statement(raw)
    statement.postgres(True)
    assert statement.text == raw


# -- Coalescer --------------------------------------------------------------------------


class Runner:
    """A ``run_batch`` that records every batch and holds it until released."""

    def __init__(self, answer: Callable[[int], int | BaseException] = lambda i: i * 10) -> None:
        self.batches: list[list[int]] = []
        self.gates: list[asyncio.Event] = []
        self.answer = answer
        self.fail_with: dict[int, BaseException] = {}  # batch index -> raised

    async def __call__(self, items: list[int]) -> list[int | BaseException]:
        index = len(self.batches)
        self.batches.append(list(items))
        gate = asyncio.Event()
        self.gates.append(gate)
        await gate.wait()
        if index in self.fail_with:
            raise self.fail_with[index]
        return [self.answer(item) for item in items]

    async def until_batches(self, count: int) -> None:
        for _ in range(200):
            if len(self.batches) >= count:
                return
            await asyncio.sleep(0)
        raise AssertionError(f"expected {count} batches, got {self.batches}")

    def release(self, index: int) -> None:
        self.gates[index].set()


async def settle_loop(turns: int = 20) -> None:
    for _ in range(turns):
        await asyncio.sleep(0)


def submit_all(coalescer: Coalescer[int, int], items: list[int]) -> list[asyncio.Task[int]]:
    return [asyncio.ensure_future(coalescer.submit(item)) for item in items]


async def test_a_lone_call_is_sent_at_once_as_a_batch_of_one() -> None:
    runner = Runner()
    coalescer: Coalescer[int, int] = Coalescer(runner, lanes=2, max_batch=64)
    task = asyncio.ensure_future(coalescer.submit(7))
    await runner.until_batches(1)
    assert runner.batches == [[7]]
    runner.release(0)
    assert await task == 70


async def test_a_lone_call_without_load_needs_no_other_caller() -> None:
    async def run_batch(items: list[int]) -> list[int | BaseException]:
        return [item + 1 for item in items]

    coalescer: Coalescer[int, int] = Coalescer(run_batch, lanes=1, max_batch=8)
    assert await asyncio.wait_for(coalescer.submit(1), 1) == 2
    assert await asyncio.wait_for(coalescer.submit(2), 1) == 3


async def test_calls_arriving_while_the_lane_is_busy_go_together_in_order() -> None:
    runner = Runner()
    coalescer: Coalescer[int, int] = Coalescer(runner, lanes=1, max_batch=64)
    first = asyncio.ensure_future(coalescer.submit(1))
    await runner.until_batches(1)
    later = submit_all(coalescer, [2, 3, 4, 5, 6])
    await settle_loop()
    assert runner.batches == [[1]], "no second batch while the only lane is busy"
    assert not any(task.done() for task in later)
    runner.release(0)
    await runner.until_batches(2)
    assert runner.batches[1] == [2, 3, 4, 5, 6]
    runner.release(1)
    assert await first == 10
    assert [await task for task in later] == [20, 30, 40, 50, 60]
    assert len(runner.batches) == 2


async def test_two_lanes_run_two_batches_at_once_and_queue_the_rest() -> None:
    runner = Runner()
    coalescer: Coalescer[int, int] = Coalescer(runner, lanes=2, max_batch=64)
    a = asyncio.ensure_future(coalescer.submit(1))
    await runner.until_batches(1)
    b = asyncio.ensure_future(coalescer.submit(2))
    await runner.until_batches(2)
    assert runner.batches == [[1], [2]]  # the second lane took the second call at once
    rest = submit_all(coalescer, [3, 4, 5, 6, 7])
    await settle_loop()
    assert len(runner.batches) == 2, "both lanes busy: the rest waits"
    runner.release(1)  # the second lane finishes first and takes everything queued
    await runner.until_batches(3)
    assert runner.batches[2] == [3, 4, 5, 6, 7]
    assert await b == 20
    assert not a.done()
    runner.release(0)
    runner.release(2)
    assert await a == 10
    assert [await task for task in rest] == [30, 40, 50, 60, 70]


async def test_calls_of_one_turn_share_one_batch() -> None:
    runner = Runner()
    coalescer: Coalescer[int, int] = Coalescer(runner, lanes=2, max_batch=64)
    tasks = submit_all(coalescer, list(range(10)))
    await runner.until_batches(1)
    await settle_loop()
    assert runner.batches == [list(range(10))]
    runner.release(0)
    assert [await task for task in tasks] == [i * 10 for i in range(10)]


async def test_max_batch_is_respected_and_order_kept() -> None:
    runner = Runner()
    coalescer: Coalescer[int, int] = Coalescer(runner, lanes=1, max_batch=3)
    first = asyncio.ensure_future(coalescer.submit(0))
    await runner.until_batches(1)
    later = submit_all(coalescer, [1, 2, 3, 4, 5, 6, 7])
    await settle_loop()
    for index in range(1, 4):
        runner.release(index - 1)
        await runner.until_batches(index + 1)
    runner.release(3)
    assert runner.batches == [[0], [1, 2, 3], [4, 5, 6], [7]]
    assert all(len(batch) <= 3 for batch in runner.batches)
    assert await first == 0
    assert [await task for task in later] == [10, 20, 30, 40, 50, 60, 70]


async def test_max_batch_with_two_lanes() -> None:
    runner = Runner()
    coalescer: Coalescer[int, int] = Coalescer(runner, lanes=2, max_batch=4)
    tasks = submit_all(coalescer, list(range(10)))
    await runner.until_batches(2)
    await settle_loop()
    assert runner.batches == [[0, 1, 2, 3], [4, 5, 6, 7]]
    runner.release(0)
    await runner.until_batches(3)
    assert runner.batches[2] == [8, 9]
    runner.release(1)
    runner.release(2)
    assert [await task for task in tasks] == [i * 10 for i in range(10)]


@pytest.mark.parametrize("fails", [False, True], ids=["answered", "failed"])
async def test_the_callers_a_batch_answers_run_before_the_lane_sends_again(fails: bool) -> None:
    # What happened, in order: a batch sent, or a caller going on with its answer (or
    # with its batch's failure).
    events: list[str] = []

    class Recording(Runner):
        async def __call__(self, items: list[int]) -> list[int | BaseException]:
            events.append(f"sent {items}")
            return await super().__call__(items)

    runner = Recording()
    if fails:
        runner.fail_with[0] = RuntimeError("statement failed")
    coalescer: Coalescer[int, int] = Coalescer(runner, lanes=1, max_batch=64)

    async def caller(item: int) -> None:
        try:
            answer: int | str = await coalescer.submit(item)
        except RuntimeError as error:
            answer = str(error)
        events.append(f"caller {item} got {answer}")

    first = asyncio.ensure_future(caller(1))
    await runner.until_batches(1)
    later = asyncio.ensure_future(caller(2))  # queued while the lane is busy
    await settle_loop()
    runner.release(0)
    await runner.until_batches(2)
    runner.release(1)
    await asyncio.gather(first, later)
    first_answer = "statement failed" if fails else "10"
    assert events == ["sent [1]", f"caller 1 got {first_answer}", "sent [2]", "caller 2 got 20"]


async def test_an_exception_answer_goes_to_its_caller_only() -> None:
    def answer(item: int) -> int | BaseException:
        return ValueError(f"bad {item}") if item == 3 else item * 10

    runner = Runner(answer)
    coalescer: Coalescer[int, int] = Coalescer(runner, lanes=1, max_batch=64)
    tasks = submit_all(coalescer, [1, 2, 3, 4, 5])
    await runner.until_batches(1)
    runner.release(0)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert runner.batches == [[1, 2, 3, 4, 5]]
    assert results[:2] == [10, 20] and results[3:] == [40, 50]
    assert isinstance(results[2], ValueError) and str(results[2]) == "bad 3"


async def test_a_raised_exception_fails_that_batch_only() -> None:
    runner = Runner()
    runner.fail_with[1] = RuntimeError("statement failed")
    coalescer: Coalescer[int, int] = Coalescer(runner, lanes=1, max_batch=64)
    first = asyncio.ensure_future(coalescer.submit(1))
    await runner.until_batches(1)
    doomed = submit_all(coalescer, [2, 3, 4])
    await settle_loop()
    runner.release(0)
    await runner.until_batches(2)
    after = submit_all(coalescer, [5, 6])  # queued behind the failing batch
    await settle_loop()
    runner.release(1)
    await runner.until_batches(3)
    runner.release(2)
    assert await first == 10
    results = await asyncio.gather(*doomed, return_exceptions=True)
    assert all(isinstance(r, RuntimeError) and str(r) == "statement failed" for r in results)
    assert [await task for task in after] == [50, 60]
    assert runner.batches == [[1], [2, 3, 4], [5, 6]]
    # The coalescer still works afterwards, and a new call is sent at once.
    again = asyncio.ensure_future(coalescer.submit(9))
    await runner.until_batches(4)
    runner.release(3)
    assert await again == 90


async def test_a_caller_cancelled_while_queued_does_not_break_the_others() -> None:
    runner = Runner()
    coalescer: Coalescer[int, int] = Coalescer(runner, lanes=1, max_batch=64)
    first = asyncio.ensure_future(coalescer.submit(1))
    await runner.until_batches(1)
    queued = submit_all(coalescer, [2, 3, 4])
    await settle_loop()
    queued[1].cancel()
    await settle_loop()
    runner.release(0)
    await runner.until_batches(2)
    runner.release(1)
    assert await first == 10
    assert await queued[0] == 20
    assert await queued[2] == 40
    assert queued[1].cancelled()


async def test_a_caller_cancelled_while_its_batch_runs_does_not_break_the_others() -> None:
    runner = Runner()
    coalescer: Coalescer[int, int] = Coalescer(runner, lanes=1, max_batch=64)
    tasks = submit_all(coalescer, [1, 2, 3])
    await runner.until_batches(1)
    tasks[0].cancel()
    await settle_loop()
    runner.release(0)
    assert tasks[0].cancelled()
    assert await tasks[1] == 20
    assert await tasks[2] == 30
    # Nothing is left stuck: the next call runs at once.
    later = asyncio.ensure_future(coalescer.submit(4))
    await runner.until_batches(2)
    runner.release(1)
    assert await later == 40


async def test_a_cancelled_caller_in_a_failing_batch_does_not_break_the_others() -> None:
    runner = Runner()
    runner.fail_with[0] = RuntimeError("boom")
    coalescer: Coalescer[int, int] = Coalescer(runner, lanes=1, max_batch=64)
    tasks = submit_all(coalescer, [1, 2, 3])
    await runner.until_batches(1)
    tasks[1].cancel()
    await settle_loop()
    runner.release(0)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[0], RuntimeError)
    assert isinstance(results[1], asyncio.CancelledError)
    assert isinstance(results[2], RuntimeError)


async def test_many_concurrent_callers_each_get_their_own_answer() -> None:
    batches: list[list[int]] = []

    async def run_batch(items: list[int]) -> list[int | BaseException]:
        batches.append(list(items))
        await asyncio.sleep(0.001)
        return [-item for item in items]

    coalescer: Coalescer[int, int] = Coalescer(run_batch, lanes=2, max_batch=16)

    async def caller(i: int) -> int:
        await asyncio.sleep((i % 7) * 0.0005)
        return await coalescer.submit(i)

    results = await asyncio.gather(*(caller(i) for i in range(300)))
    assert results == [-i for i in range(300)]
    assert sorted(item for batch in batches for item in batch) == list(range(300))
    assert len(batches) < 300
    assert max(len(batch) for batch in batches) <= 16


# -- is_unavailable ---------------------------------------------------------------------


class FakeDriverError(Exception):
    def __init__(self, message: str, sqlstate: str) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


@pytest.mark.parametrize(
    "error",
    [
        ConnectionRefusedError(111, "Connect call failed"),
        OSError(113, "No route to host"),
        TimeoutError(),
        exc.StoreUnavailable(),
        sqlite3.OperationalError("database is locked"),
        sqlite3.OperationalError("unable to open database file"),
        sqlite3.OperationalError("disk I/O error"),
        FakeDriverError("server gone", "08006"),
        FakeDriverError("administrator command", "57P01"),
        FakeDriverError("too many clients already", "53300"),
    ],
    ids=repr,
)
def test_errors_that_mean_the_database_is_not_there(error: BaseException) -> None:
    assert is_unavailable(error)


@pytest.mark.parametrize(
    "error",
    [
        sqlite3.IntegrityError("UNIQUE constraint failed: t.id"),
        sqlite3.OperationalError("no such table: missing"),
        FakeDriverError('duplicate key value violates unique constraint "pk"', "23505"),
        FakeDriverError("value too long for type character varying(32)", "22001"),
        ValueError("not a database error"),
    ],
    ids=repr,
)
def test_errors_of_our_own_sql_or_data_are_not_unavailability(error: BaseException) -> None:
    assert not is_unavailable(error)


def test_a_wrapped_os_error_is_unavailability() -> None:
    try:
        try:
            raise ConnectionResetError(104, "reset")
        except ConnectionResetError as inner:
            raise RuntimeError("driver failed") from inner
    except RuntimeError as outer:
        assert is_unavailable(outer)
