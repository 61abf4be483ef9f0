"""The dashboard at ``/admin/ui`` (admin token). Served by the gateway itself."""

from __future__ import annotations

from aiohttp import web

from .proxy import Gateway


def add_routes(app: web.Application, gateway: Gateway) -> None:
    """Routes of the dashboard (filled in by the dashboard work)."""
