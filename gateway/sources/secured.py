"""What the sources share to reach a secured cluster: the client TLS context of a
source's ``ca_file``, ``cert_file`` and ``key_file``, and the refusal a source gives at
start when its cluster turns the gateway's settings down (``SourceRefused``).

A source that cannot reach its cluster at start starts anyway (its checks answer 503
until the cluster answers, as when the cluster goes away later). One whose cluster
answers and refuses the certificate or the credentials stops ``serve`` with a message
that names the setting: that refusal will not pass by itself.
"""

from __future__ import annotations

import ssl


class SourceRefused(Exception):
    """A lease source's cluster refused the gateway's TLS or authentication settings."""


def client_context(
    ca_file: str | None, cert_file: str | None, key_file: str | None
) -> ssl.SSLContext:
    """A client context that verifies the server (with ``ca_file``, else the system's
    CAs, and its host name) and presents the client certificate when there is one."""
    context = ssl.create_default_context(cafile=ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert_file is not None:
        context.load_cert_chain(cert_file, key_file)
    return context


def tls_advice(source: str, error: BaseException) -> str:
    """What a failed TLS handshake most likely means, with the settings to look at."""
    text = str(error)
    if "CERTIFICATE_VERIFY_FAILED" in text or isinstance(error, ssl.SSLCertVerificationError):
        return (
            f"lease source {source}: the server's certificate is not trusted ({text}); "
            "set ca_file to the CA that signed it"
        )
    return (
        f"lease source {source}: the TLS handshake failed ({text}); if the server asks for "
        "a client certificate, set cert_file and key_file"
    )
