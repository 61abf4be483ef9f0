"""``limit`` of the listings (``lease_core.api.query_limit``): ASCII digits only. Unicode
digits such as ``²`` pass ``str.isdigit`` but not ``int``: Schemathesis found
``GET /admin/unknown-outcomes?limit=%C2%B2`` answered 500 ``internal-error``."""

from __future__ import annotations

import pytest

from lease_core import exceptions as exc
from lease_core.api import MAX_LIST_LIMIT, query_limit


@pytest.mark.parametrize("raw", ["\u00b2", "\u0663", "0", "-1", "1.5", "", str(MAX_LIST_LIMIT + 1)])
def test_a_limit_that_is_not_a_whole_number_in_range_is_a_400(raw: str) -> None:
    with pytest.raises(exc.InvalidRequest):
        query_limit(raw, default=100)


def test_a_limit_in_range_and_none() -> None:
    assert query_limit("7", default=100) == 7
    assert query_limit(None, default=100) == 100
