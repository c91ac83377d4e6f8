"""TLS on both of a router's ports from one set of PEM files (vLLM's flag
names): HTTPS through uvicorn's ssl_* settings, and gRPC through
grpc.ssl_server_credentials. Off unless a certificate is given."""

from __future__ import annotations

import ssl
from dataclasses import dataclass

CERT_REQS = (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED)  # 0, 1, 2: as --ssl-cert-reqs takes them


@dataclass(slots=True)
class TLSFiles:
    certfile: str  # the server's certificate chain (PEM)
    keyfile: str  # its private key (PEM)
    ca_certs: str | None = None  # CAs that sign client certificates (PEM)
    cert_reqs: int = ssl.CERT_NONE  # client certificates: 0 not asked, 1 checked when sent, 2 required

    @classmethod
    def from_options(cls, o) -> TLSFiles | None:
        """From options with ssl_certfile, ssl_keyfile, ssl_ca_certs and ssl_cert_reqs; None without a certificate."""
        if not o.ssl_certfile:
            return None
        return cls(o.ssl_certfile, o.ssl_keyfile, o.ssl_ca_certs, o.ssl_cert_reqs)

    def uvicorn_settings(self) -> dict:
        return {
            "ssl_certfile": self.certfile,
            "ssl_keyfile": self.keyfile,
            "ssl_ca_certs": self.ca_certs,
            "ssl_cert_reqs": self.cert_reqs,
        }

    def grpc_credentials(self):
        """gRPC checks a client's certificate only when it requires one (2);
        with 1 it asks for none."""
        import grpc

        key, cert = _read(self.keyfile), _read(self.certfile)
        roots = _read(self.ca_certs) if self.ca_certs else None
        required = self.cert_reqs == ssl.CERT_REQUIRED
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=roots, require_client_auth=required)


def check_tls_options(certfile: str | None, keyfile: str | None, ca_certs: str | None, cert_reqs: int) -> None:
    """The combinations that make sense; ValueError names the flag otherwise."""
    if bool(certfile) != bool(keyfile):
        raise ValueError("ssl_certfile and ssl_keyfile go together: set both for TLS, or neither")
    if cert_reqs not in CERT_REQS:
        raise ValueError(f"ssl_cert_reqs must be 0 (none), 1 (optional) or 2 (required); got {cert_reqs!r}")
    if not certfile and (ca_certs or cert_reqs != ssl.CERT_NONE):
        raise ValueError("ssl_ca_certs and ssl_cert_reqs need TLS on (ssl_certfile and ssl_keyfile)")
    if cert_reqs != ssl.CERT_NONE and not ca_certs:
        raise ValueError("ssl_cert_reqs 1 or 2 checks client certificates against ssl_ca_certs: set it")


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise OSError(f"cannot read the TLS file {path}: {e.strerror}") from None
