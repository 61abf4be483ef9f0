"""Fencegate's lease service: jobs, expiring leases and strictly increasing generations."""

__version__ = "0.1.0"
