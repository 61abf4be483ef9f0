"""The one message for an optional library that is not installed: which module needs it
and what to install, instead of a bare ``No module named 'httpx'``.

.. code-block:: python

    try:
        import httpx
    except ModuleNotFoundError as error:
        needs(error, __name__, "httpx", install="'fencegate-client[httpx]'")
        raise
"""

from __future__ import annotations


def needs(error: ModuleNotFoundError, module: str, library: str, *, install: str) -> None:
    """Raise the clear error when ``error`` is ``library`` (or one of its modules) not
    being there; return (the caller re-raises ``error``) when something else is missing,
    which is a broken install of that library, not a missing extra."""
    missing = error.name or ""
    if missing != library and not missing.startswith(library + "."):
        return
    raise ModuleNotFoundError(
        f"{module} needs {library}: pip install {install}", name=error.name
    ) from error
