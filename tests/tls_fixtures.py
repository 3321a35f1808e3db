"""A throwaway PKI (CA, daemon certificates, a rogue CA) written for a test, and its fixture."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme

from xdc.config import TlsConfig
from xdc.config_entries import entries


@dataclass
class Pki:
    """Certificates on disk: one deployment CA, a foreign CA, and leaves issued by either."""

    root: Path
    ca: trustme.CA
    foreign: trustme.CA

    @property
    def ca_file(self) -> str:
        return str(self.root / "ca.pem")

    def leaf(
        self,
        name: str,
        *identities: str,
        ca: trustme.CA | None = None,
        expired: bool = False,
    ) -> tuple[str, str]:
        """Write a certificate for ``identities`` and its key; return (cert_file, key_file)."""
        kw = {}
        if expired:
            now = datetime.datetime.now(datetime.UTC)
            kw = {
                "not_before": now - datetime.timedelta(days=30),
                "not_after": now - datetime.timedelta(days=1),
            }
        cert = (ca or self.ca).issue_cert(*identities, **kw)  # type: ignore[arg-type]
        cert_file, key_file = self.root / f"{name}.pem", self.root / f"{name}.key"
        cert.cert_chain_pems[0].write_to_path(str(cert_file))
        cert.private_key_pem.write_to_path(str(key_file))
        return str(cert_file), str(key_file)

    def config(
        self,
        name: str,
        *identities: str,
        allowed: str = "",
        server_name: str = "",
        record_layer: str = "sealed",
        record_cipher: str = "auto",
        **kw: bool,
    ) -> TlsConfig:
        cert_file, key_file = self.leaf(name, *identities, **kw)  # type: ignore[arg-type]
        return TlsConfig(
            "mutual",
            self.ca_file,
            cert_file,
            key_file,
            tuple(entries(allowed)),
            server_name,
            record_layer,
            record_cipher,
        )

    def foreign_config(self, name: str, *identities: str) -> TlsConfig:
        cert_file, key_file = self.leaf(name, *identities, ca=self.foreign)
        return TlsConfig("mutual", self.ca_file, cert_file, key_file)


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    return Pki(tmp_path, ca, trustme.CA())
