"""Jepsen-style verification of Fencegate: ``python -m verify run`` and ``check``."""
