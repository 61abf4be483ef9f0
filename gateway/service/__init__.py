"""The process around the request path: ``server`` (both listeners, start-up checks),
``cli`` (``fencegate``), ``admin`` and ``dashboard`` (the control listener's admin API
and page), ``auth``, ``tls``, ``parse_errors``, ``tasks`` (periodic purges) and ``demo``."""
