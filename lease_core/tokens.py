"""Lease tokens: 192 random bits behind a recognisable prefix, stored only as a hash."""

from __future__ import annotations

import hashlib
import itertools
import os
import re
import secrets

PREFIX = "fgl_"
TOKEN_PATTERN = re.compile(r"fgl_[A-Za-z0-9_-]{32}")


def new_token() -> tuple[str, str]:
    """A fresh token and the hash the store keeps of it."""
    token = PREFIX + secrets.token_urlsafe(24)
    return token, hash_token(token)


def hash_token(token: str) -> str:
    # The token carries 192 random bits, so a fast hash is enough: there is nothing to
    # brute-force that a slow one would protect.
    return hashlib.sha256(token.encode("ascii")).hexdigest()


def is_well_formed(token: str) -> bool:
    return TOKEN_PATTERN.fullmatch(token) is not None


class _Serial:
    """Identifiers unique across processes without a system call each: 64 random bits
    drawn once per process (again in a forked child) and a counter. For internal ids
    that must not repeat but need not be unguessable (a write attempt, a request id)."""

    def __init__(self) -> None:
        self._reseed()
        os.register_at_fork(after_in_child=self._reseed)

    def _reseed(self) -> None:
        self._prefix = secrets.token_hex(8)
        self._count = itertools.count(1)

    def __call__(self) -> str:
        return f"{self._prefix}{next(self._count):016x}"


new_serial_id = _Serial()
"""32 hex characters, unique per call (see ``_Serial``)."""
