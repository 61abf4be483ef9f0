"""The process around the request path: ``server`` (both listeners, start-up checks),
``cli`` (``fencegate``: the parser and the dispatch; its commands in ``serve_cli``,
``check_config`` and ``admin_cli``, what they share in ``cli_common``), ``admin`` and
``dashboard`` (the control listener's admin API and page), ``auth``, ``tls``,
``parse_errors``, ``tasks`` (periodic purges) and ``demo``."""
