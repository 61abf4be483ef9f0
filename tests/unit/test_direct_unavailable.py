"""``is_unavailable`` over asyncpg's own exception classes (issue 52, item 2): a server
that answered is judged by its SQLSTATE's class, never by its text.

Each error is built as asyncpg builds it from the server's message (``PostgresError.new``
picks the class from the code), so the class and the ``sqlstate`` are the real ones.
"""

from __future__ import annotations

import asyncpg  # type: ignore[import-untyped]
import pytest

from lease_core.direct import is_unavailable


def from_server(sqlstate: str, message: str, severity: str = "ERROR") -> BaseException:
    """The error asyncpg raises for a server's message with this code."""
    error: BaseException = asyncpg.PostgresError.new(
        {"C": sqlstate, "M": message, "S": severity, "V": severity}
    )
    return error


UNAVAILABLE = [
    # 08: connection exceptions
    ("08000", asyncpg.PostgresConnectionError, "connection exception"),
    ("08003", asyncpg.ConnectionDoesNotExistError, "connection does not exist"),
    ("08006", asyncpg.ConnectionFailureError, "connection failure"),
    ("08001", asyncpg.ClientCannotConnectError, "could not connect to server"),
    ("08004", asyncpg.ConnectionRejectionError, "server rejected the connection"),
    # 53: insufficient resources
    ("53000", asyncpg.InsufficientResourcesError, "insufficient resources"),
    ("53100", asyncpg.DiskFullError, "could not extend file"),
    ("53200", asyncpg.OutOfMemoryError, "out of memory"),
    ("53300", asyncpg.TooManyConnectionsError, "sorry, too many clients already"),
    # 55: object not in prerequisite state
    (
        "55000",
        asyncpg.ObjectNotInPrerequisiteStateError,
        'database "app" is not currently accepting connections',
    ),
    ("55006", asyncpg.ObjectInUseError, 'database "app" is being accessed by other users'),
    # 57P0x: operator intervention that ends sessions
    ("57P01", asyncpg.AdminShutdownError, "terminating connection due to administrator command"),
    ("57P02", asyncpg.CrashShutdownError, "terminating connection because of crash"),
    ("57P03", asyncpg.CannotConnectNowError, "the database system is starting up"),
]


@pytest.mark.parametrize(
    ("sqlstate", "cls", "message"), UNAVAILABLE, ids=[u[0] for u in UNAVAILABLE]
)
def test_a_server_code_that_says_it_cannot_serve_now_is_unavailability(
    sqlstate: str, cls: type[BaseException], message: str
) -> None:
    for severity in ("ERROR", "FATAL"):
        error = from_server(sqlstate, message, severity)
        assert type(error) is cls
        assert error.sqlstate == sqlstate  # type: ignore[attr-defined]
        assert is_unavailable(error), repr(error)


@pytest.mark.parametrize(
    "error",
    [
        # A server's code outside those classes, whatever its words say: its text is
        # never read (these mention a connection, a shutdown, being closed).
        from_server("23505", 'duplicate key value violates unique constraint "connections_pk"'),
        from_server("42601", 'syntax error at or near "shutdown"'),
        from_server("22001", "value too long for type character varying(32): closed"),
        from_server("42P01", 'relation "terminated_connections" does not exist'),
        # asyncpg's own: a value it could not encode (a ValueError), whatever its words.
        asyncpg.DataError("invalid input for query argument $1: 'connect' (expected int)"),
    ],
    ids=repr,
)
def test_our_sql_or_values_are_not_unavailability(error: BaseException) -> None:
    assert not is_unavailable(error)


def test_the_counter_examples_are_the_classes_asyncpg_raises() -> None:
    assert type(from_server("23505", "x")) is asyncpg.UniqueViolationError
    assert type(from_server("42601", "x")) is asyncpg.PostgresSyntaxError


@pytest.mark.parametrize(
    "error",
    [
        asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
        asyncpg.InterfaceError("connection is closed"),
        asyncpg.InterfaceError("cannot perform operation: another operation is in progress"),
        asyncpg.InternalClientError("unexpected protocol state"),
    ],
    ids=repr,
)
def test_asyncpg_connection_errors_are_unavailability(error: BaseException) -> None:
    assert is_unavailable(error)
