"""Where the gateway listens: the listen addresses (``proxy_listen``, ``control_listen``)
and the listeners' TLS (``[tls]``, ``[tls.proxy]``, ``[tls.control]``)."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

LISTENERS: tuple[Literal["proxy"], Literal["control"]] = ("proxy", "control")


def _listen(value: str) -> str:
    parse_listen(value)
    return value


def parse_listen(value: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` into its parts."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"must be host:port, got {value!r}")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


Listen = Annotated[str, AfterValidator(_listen)]


ClientCerts = Literal["none", "optional", "required"]


class ListenerTlsSettings(BaseModel):
    """``[tls.proxy]`` / ``[tls.control]``: what differs for one listener; a key left
    empty is taken from ``[tls]``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cert_file: str = ""
    key_file: str = ""
    client_ca_file: str = ""
    client_certs: Literal["", "none", "optional", "required"] = ""


class ListenerTls(BaseModel):
    """The TLS of one listener, ``[tls]`` and its ``[tls.<listener>]`` merged."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    listener: Literal["proxy", "control"]
    cert_file: Path
    key_file: Path
    client_ca_file: Path | None
    client_certs: ClientCerts


class TlsSettings(BaseModel):
    """TLS of the listeners: ``[tls]`` for both, ``[tls.proxy]`` / ``[tls.control]`` for
    one. A listener with a certificate speaks only TLS; one without speaks plain HTTP.
    ``client_certs``: ``"none"`` asks for no client certificate, ``"optional"`` verifies
    one when the client sends it, ``"required"`` refuses a handshake without a
    certificate signed by ``client_ca_file``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cert_file: str = ""
    key_file: str = ""
    client_ca_file: str = ""
    client_certs: ClientCerts = "none"
    proxy: ListenerTlsSettings = Field(default_factory=ListenerTlsSettings)
    control: ListenerTlsSettings = Field(default_factory=ListenerTlsSettings)

    def listener(self, name: Literal["proxy", "control"]) -> ListenerTls | None:
        """The merged settings of ``name``, or None when it speaks plain HTTP."""
        own: ListenerTlsSettings = getattr(self, name)
        cert = own.cert_file or self.cert_file
        key = own.key_file or self.key_file
        if not cert and not key:
            return None
        if not cert or not key:
            raise ValueError(f"tls.{name}: cert_file and key_file go together; one is missing")
        client_ca = own.client_ca_file or self.client_ca_file
        client_certs = own.client_certs or self.client_certs
        if client_certs != "none" and not client_ca:
            raise ValueError(
                f"tls.{name}: client_certs = {client_certs!r} needs client_ca_file (the CA "
                "that signs the workers' certificates)"
            )
        return ListenerTls(
            listener=name,
            cert_file=Path(cert),
            key_file=Path(key),
            client_ca_file=Path(client_ca) if client_ca else None,
            client_certs=client_certs,
        )

    @property
    def listeners(self) -> dict[str, ListenerTls]:
        """The listeners that speak TLS, by name."""
        out: dict[str, ListenerTls] = {}
        for name in LISTENERS:
            listener = self.listener(name)
            if listener is not None:
                out[name] = listener
        return out

    @model_validator(mode="after")
    def _complete(self) -> TlsSettings:
        for name in LISTENERS:
            self.listener(name)
        return self

    def resolved(self, base: Path) -> TlsSettings:
        """Relative file names resolved against ``base`` (the config file's folder)."""

        def fix(model: BaseModel) -> dict[str, str]:
            return {
                key: str(base / value)
                for key in ("cert_file", "key_file", "client_ca_file")
                if (value := getattr(model, key)) and not Path(value).is_absolute()
            }

        return self.model_copy(
            update={
                **fix(self),
                "proxy": self.proxy.model_copy(update=fix(self.proxy)),
                "control": self.control.model_copy(update=fix(self.control)),
            }
        )
