"""Fencegate's fencing gateway: a reverse proxy that lets only current, new writes through."""
