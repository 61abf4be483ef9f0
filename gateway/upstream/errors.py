"""How an exchange with an upstream failed: what the forwarding may conclude from it.

``NotSent``: no byte of the request left, the write may be treated as never made.
``NoAnswer``: the request was sent (maybe in part) and no answer that can be read came
back: its outcome is unknown. ``CutShort``: the answer's head arrived, its body did not
arrive whole.
"""

from __future__ import annotations


class UpstreamError(Exception):
    """The exchange with the upstream failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or self.__doc__)


class NotSent(UpstreamError):
    """Nothing of the request was sent: the upstream could not be reached."""


class ConnectTimeout(NotSent):
    """Nothing of the request was sent: connecting to the upstream timed out."""


class NoAnswer(UpstreamError):
    """The request was sent (maybe in part), and no answer came: its outcome is unknown."""


class NoAnswerInTime(NoAnswer):
    """The request was sent, and its answer did not come in time: its outcome is unknown."""


class HeadTooLarge(NoAnswer):
    """The request was sent, and the answer's head (its status line and headers) was over
    the gateway's limit: the answer was not read, so the outcome is unknown."""


class CutShort(UpstreamError):
    """The upstream's answer began and did not arrive whole."""
