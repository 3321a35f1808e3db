"""deploy/configs: the two-datacenter example configs pass `xdc config check`, list every field
of their role, and agree with each other (ports, addresses, protocol limits, tokens)."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

import pytest

from tests.deploy_fixtures import DEPLOY, load_deploy_config, materialise
from xdc import cli
from xdc.config import Config, ConfigError, load_config
from xdc.config_example import sections_for

CONFIGS = {"prfaas-sender.toml": "sender", "pd-receiver.toml": "receiver", "router.toml": "router"}


@pytest.fixture(autouse=True)
def _no_xdc_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.startswith("XDC_"):
            monkeypatch.delenv(key)


@pytest.mark.parametrize("name", CONFIGS)
def test_config_check_passes(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = materialise(name, tmp_path)
    assert cli.main(["config", "check", str(path)]) == 0
    assert capsys.readouterr().out.strip().endswith(": ok")


def test_config_check_names_missing_certificates() -> None:
    """As shipped (no /etc/xdc/tls here) the daemon configs fail on exactly the TLS files."""
    for name in ("prfaas-sender.toml", "pd-receiver.toml"):
        with pytest.raises(ConfigError) as e:
            load_config(DEPLOY / "configs" / name, env={})
        fields = sorted(p.split(":")[0] for p in e.value.problems)
        assert fields == ["tls.ca_file", "tls.cert_file", "tls.key_file"], e.value.problems


@pytest.mark.parametrize(("name", "role"), CONFIGS.items())
def test_every_field_of_the_role_is_present_and_commented(name: str, role: str) -> None:
    text = (DEPLOY / "configs" / name).read_text()
    data = tomllib.loads(text)
    assert list(data) == sections_for(role)
    cfg = Config()
    for section, body in data.items():
        assert set(body) == {f.name for f in dataclasses.fields(getattr(cfg, section))}, section
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^\w+ = ", line):
            assert lines[i - 1].startswith("# "), f"{name}: {line!r} has no comment above it"


def test_the_two_datacenters_agree(tmp_path: Path) -> None:
    snd = load_deploy_config("prfaas-sender.toml", tmp_path / "s")
    rcv = load_deploy_config("pd-receiver.toml", tmp_path / "r")
    rtr = load_deploy_config("router.toml", tmp_path / "t")
    assert (snd.sender.peer_host, snd.sender.peer_port) == (
        rcv.receiver.listen_host,
        rcv.receiver.listen_port,
    )
    assert snd.limits == rcv.limits  # both peers enforce their own limits on every frame
    assert snd.sender.chunk_bytes <= rcv.limits.max_chunk_bytes
    assert snd.monitor.router_url == f"http://{rtr.router.listen_host}:{rtr.router.listen_port}"
    assert snd.node.datacenter != rcv.node.datacenter == rtr.node.datacenter
    assert len({snd.node.id, rcv.node.id, rtr.node.id}) == 3

    # mTLS names: the sender expects the receiver's name, the receiver admits the sender's.
    # Convention (README): <host>.pem carries the SAN <host>.xdc.example.
    def host(cert_file: str) -> str:
        return Path(cert_file).name.removesuffix(".pem")

    assert snd.tls.server_name == f"{host(rcv.tls.cert_file)}.xdc.example"
    assert f"{host(snd.tls.cert_file)}.xdc.example" in rcv.tls.allowed()
    # every receiver the sender may ship to is admitted by name (issue 28: decode nodes)
    names = {snd.tls.server_name, *(n for n in snd.sender.allowed_peer_names().values() if n)}
    assert snd.tls.allowed() == names, (snd.tls.allowed(), names)
    for c in (snd, rcv, rtr):
        assert c.node.log_json  # request ids are followed through JSON logs (README)
    for sock in (snd.sender.control_socket, rcv.receiver.control_socket):
        assert sock.startswith("/run/xdc/")  # the units' RuntimeDirectory=xdc
    # secrets come from the EnvironmentFile, never from the checked-in files
    assert not snd.monitor.router_token
    assert not (rtr.router.gateway_token or rtr.router.daemon_token)


def test_env_example_sets_real_config_fields() -> None:
    lines = (DEPLOY / "systemd" / "xdc.env.example").read_text().splitlines()
    env = dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))
    assert env and all(k.startswith("XDC_") for k in env)
    cfg = load_config(None, env=env)  # an unknown section or field would raise ConfigError
    assert cfg.router.daemon_token == cfg.monitor.router_token == env["XDC_ROUTER__DAEMON_TOKEN"]
    assert cfg.router.gateway_token == env["XDC_ROUTER__GATEWAY_TOKEN"]
