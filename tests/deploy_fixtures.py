"""The shipped deploy/ configs, loaded as a deployment would (TLS paths pointed at a test PKI)."""

from __future__ import annotations

import re
from pathlib import Path

import trustme

from xdc.config import Config, load_config

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


TLS_DIR = "/etc/xdc/tls/"


def materialise(name: str, tmp_path: Path) -> Path:
    """Copy a deploy config to ``tmp_path`` with real certificates where it names TLS files.

    The configs point at /etc/xdc/tls/ on the target host; here those files are made by one
    throwaway CA (trustme) so the check sees a config that is complete, not one with holes.
    """
    text = (DEPLOY / "configs" / name).read_text()
    ca = trustme.CA()
    tls = tmp_path / "tls"
    tls.mkdir(parents=True, exist_ok=True)
    for fname in set(re.findall(re.escape(TLS_DIR) + r"([\w.-]+)", text)):
        target = tls / fname
        if fname == "ca.pem":
            ca.cert_pem.write_to_path(str(target))
        elif fname.endswith("-key.pem"):
            ca.issue_cert(fname.removesuffix("-key.pem")).private_key_pem.write_to_path(str(target))
        else:
            ca.issue_cert(fname.removesuffix(".pem")).cert_chain_pems[0].write_to_path(str(target))
    out = tmp_path / name
    out.write_text(text.replace(TLS_DIR, f"{tls}/"))
    return out


def load_deploy_config(name: str, tmp_path: Path) -> Config:
    return load_config(materialise(name, tmp_path), env={})
