"""The files the lease sources read at start (``ca_file``, ``cert_file``, ``key_file``):
each must exist, be readable and load (a CA bundle, a certificate with its key), or
``serve`` and ``check-config`` name it (``file_problems``), every problem at once."""

from __future__ import annotations

import os
import ssl

from gateway.config.settings import Settings
from gateway.config.sources import source_files


def file_problems(settings: Settings) -> list[str]:
    problems: list[str] = []
    for index, source in enumerate(settings.lease_sources):
        files = source_files(source)
        unusable = False
        for key, path in files.items():
            problem = _unusable(path)
            if problem is not None:
                problems.append(f"lease_sources.{index}.{key}: {path}: {problem}")
                unusable = True
        if unusable:
            continue
        context = ssl.create_default_context()
        if "ca_file" in files:
            try:
                context.load_verify_locations(cafile=files["ca_file"])
            except (ssl.SSLError, ValueError) as error:
                problems.append(
                    f"lease_sources.{index}.ca_file: {files['ca_file']}: not a PEM CA "
                    f"certificate ({error})"
                )
        if "cert_file" in files:
            try:
                context.load_cert_chain(files["cert_file"], files.get("key_file"))
            except (ssl.SSLError, ValueError) as error:
                problems.append(
                    f"lease_sources.{index}.cert_file: {files['cert_file']} with key_file "
                    f"{files.get('key_file')}: not a PEM certificate and its key ({error})"
                )
    return problems


def _unusable(path: str) -> str | None:
    if not os.path.exists(path):
        return "no such file"
    if os.path.isdir(path):
        return "a directory, not a file"
    if not os.access(path, os.R_OK):
        return "not readable by this process"
    try:
        with open(path, "rb"):
            pass
    except OSError as error:
        return f"cannot be read ({error.strerror or error})"
    return None
