"""Config: one typed object from TOML, XDC_* environment and flags; every problem reported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from xdc.scheduler.profile import ProfileError, load_profile
from xdc.scheduler.sim.workload import ReplayInputError, load_trace

from xdc.config import ConfigError, load_config, to_toml


def test_layering_file_env_flags(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[sender]\nconnections = 4\npeer_host = "10.0.0.9"\n[node]\nid = "a"\n')
    cfg = load_config(
        f,
        env={"XDC_SENDER__CONNECTIONS": "6", "XDC_NODE__LOG_JSON": "true", "OTHER": "x"},
        overrides={"sender.connections": "12"},
    )
    assert cfg.sender.connections == 12  # flag beats env beats file
    assert cfg.sender.peer_host == "10.0.0.9"
    assert cfg.node.log_json is True and cfg.node.id == "a"


def test_every_problem_reported_with_its_field(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(
        '[sender]\nconnections = 0\npeer_port = "x"\nbogus = 1\n'
        "[receiver]\npool_bytes = 1.5\n[nope]\na = 1\n"
    )
    with pytest.raises(ConfigError) as e:
        load_config(f, env={"XDC_MONITOR__SAMPLE_HZ": "-1"})
    text = "\n".join(e.value.problems)
    for needle in (
        "sender.connections",
        "sender.peer_port",
        "sender.bogus",
        "receiver.pool_bytes",
        "nope.a",
        "monitor.sample_hz",
    ):
        assert needle in text, (needle, text)


def test_bool_is_not_an_int_and_toml_round_trips(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        load_config(None, env={}, overrides={"sender.connections": True})
    cfg = load_config(None, env={}, overrides={"node.id": 'we"ird\\id'})
    f = tmp_path / "rt.toml"
    f.write_text(to_toml(cfg))
    assert load_config(f, env={}) == cfg


def test_list_settings_are_arrays_in_toml_and_comma_separated_from_env_and_flags(
    tmp_path: Path,
) -> None:
    """One typed list per setting (issue 31): a TOML array, or the same entries
    comma-separated from the environment or --set, parsed once into a tuple; what is not a
    list of the right type is a problem naming the field, and a config round-trips."""
    f = tmp_path / "lists.toml"
    f.write_text(
        '[sender]\nallowed_peers = ["10.0.0.2:7400", "pd-b:7400=rx-b.example"]\n'
        "[node]\nallowed_uids = [65534, 1001]\n"
        '[tls]\nallowed_peers = "a.example, b.example"\n'  # a string is split the same way
    )
    cfg = load_config(
        f,
        env={"XDC_GATEWAY__CLIENT_TOKENS": "t1, t2,", "XDC_SENDER__PEER_EXTRA_ADDRESSES": "h:1"},
        overrides={"gateway.nodes": "pd=http://pd:8000,pf=http://pf:8100"},
    )
    assert cfg.sender.allowed_peers == ("10.0.0.2:7400", "pd-b:7400=rx-b.example")
    assert cfg.sender.allowed_peer_names() == {
        ("10.0.0.2", 7400): None,
        ("pd-b", 7400): "rx-b.example",
    }
    assert cfg.node.allowed_uids == (65534, 1001)
    assert cfg.tls.allowed() == frozenset({"a.example", "b.example"})
    assert cfg.gateway.client_tokens == ("t1", "t2")
    assert cfg.gateway.nodes == ("pd=http://pd:8000", "pf=http://pf:8100")
    assert cfg.sender.extra_addresses() == (("h", 1),)
    rt = tmp_path / "rt.toml"
    rt.write_text(to_toml(cfg))
    assert load_config(rt, env={}) == cfg
    with pytest.raises(ConfigError) as e:
        load_config(
            None,
            env={"XDC_NODE__ALLOWED_UIDS": "1000,root"},
            overrides={"sender.allowed_peers": "h:1=", "router.vllm_metrics": "x"},
        )
    text = "\n".join(e.value.problems)
    for needle in ("node.allowed_uids", "sender.allowed_peers", "router.vllm_metrics"):
        assert needle in text, (needle, text)


def test_config_check_command(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[sender]\nconnections = 0\nchunk_bytes = 1\n")
    r = subprocess.run(
        [sys.executable, "-m", "xdc", "config", "check", str(bad)], capture_output=True, text=True
    )
    assert r.returncode == 2
    assert "sender.connections" in r.stderr and "sender.chunk_bytes" in r.stderr
    good = tmp_path / "good.toml"
    good.write_text("[sender]\nconnections = 3\n")
    r = subprocess.run(
        [sys.executable, "-m", "xdc", "config", "check", str(good)], capture_output=True, text=True
    )
    assert r.returncode == 0 and "ok" in r.stdout


@pytest.mark.parametrize("cmd", ["demo", "sender", "receiver", "bench transfer", "config check"])
def test_every_command_has_help(cmd: str) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "xdc", *cmd.split(), "--help"], capture_output=True, text=True
    )
    assert r.returncode == 0 and "usage:" in r.stdout


def test_link_names_and_router_replica_settings_are_checked() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(
            env={},
            overrides={
                "node.cluster": "bad name",
                "sender.peer_cluster": "",
                "router.shared_state": "etcd",
                "router.event_loop": "trio",
                "router.redis_namespace": "a:b",
                "router.redis_timeout_s": "0",
            },
        )
    text = "\n".join(e.value.problems)
    for needle in (
        "node.cluster",
        "sender.peer_cluster",
        "router.shared_state",
        "router.event_loop",
        "router.redis_namespace",
        "router.redis_timeout_s",
    ):
        assert needle in text, needle
    with pytest.raises(ConfigError, match=r"router\.redis_url"):
        load_config(
            env={},
            overrides={"router.shared_state": "redis", "router.redis_url": "http://x"},
        )
    cfg = load_config(
        env={}, overrides={"node.cluster": "prfaas-a", "router.shared_state": "redis"}
    )
    assert cfg.node.cluster == "prfaas-a" and cfg.sender.peer_cluster == "pd"


def test_a_config_path_that_is_a_directory_is_a_one_line_error(tmp_path: Path) -> None:
    """It printed a traceback (issue 13 class 9)."""
    out = subprocess.run(
        [sys.executable, "-m", "xdc", "receiver", "--config", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2, out
    assert "cannot read: a directory" in out.stderr and "Traceback" not in out.stderr


def _unusable_files(tmp: Path) -> dict[str, tuple[Path, str]]:
    """Paths an operator may name by mistake, and what the refusal must say."""
    fifo = tmp / "fifo"
    os.mkfifo(fifo)
    binary = tmp / "binary.toml"
    binary.write_bytes(b"\x1f\x8b\x08\x00" + bytes(range(256)))
    digits = tmp / "digits.toml"
    digits.write_text("[sender]\nconnections = " + "9" * 5000 + "\n")
    huge = tmp / "huge.toml"
    with huge.open("wb") as f:
        f.truncate(2 << 20)  # sparse: 2 MiB of zeros, over the 1 MiB config cap
    return {
        "endless device": (Path("/dev/zero"), "not a regular file"),
        "fifo nobody writes": (fifo, "not a regular file"),
        "directory": (tmp, "a directory"),
        "binary": (binary, "not UTF-8 text"),
        "integer of 5000 digits": (digits, "not valid TOML"),
        "over the size cap": (huge, "over the 1048576-byte limit"),
    }


def test_an_unusable_config_file_is_one_clear_problem_and_never_a_hang(tmp_path: Path) -> None:
    """/dev/zero used to be read until memory ran out, a FIFO blocked forever, an integer of
    5000 digits was a ValueError traceback."""
    for what, (path, why) in _unusable_files(tmp_path).items():
        with pytest.raises(ConfigError) as e:
            load_config(path, env={})
        assert why in str(e.value), (what, e.value)


def test_an_unusable_profile_or_trace_is_one_clear_problem(tmp_path: Path) -> None:
    files = _unusable_files(tmp_path)
    for what in ("endless device", "fifo nobody writes", "binary"):
        path, why = files[what]
        with pytest.raises(ProfileError) as e:
            load_profile(path)
        assert why in str(e.value), (what, e.value)
        with pytest.raises(ReplayInputError) as r:
            load_trace(path)
        assert why in str(r.value), (what, r.value)
    out = subprocess.run(
        [sys.executable, "-m", "xdc", "router", "--profile", str(files["binary"][0])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "not UTF-8 text" in out.stderr, out
    assert "Traceback" not in out.stderr


def test_record_cipher_is_checked_and_aegis_only_needs_pynacl() -> None:
    with pytest.raises(ConfigError, match=r"tls\.record_cipher: 'chacha' is not one of"):
        load_config(None, env={"XDC_TLS__RECORD_CIPHER": "chacha"})
    assert load_config(None, env={}).tls.record_cipher == "auto"
    ok = load_config(None, env={}, overrides={"tls.record_cipher": "aegis-128l"})
    assert ok.tls.record_cipher == "aegis-128l"
    # a process whose PyNaCl cannot be imported refuses "aegis-128l" with the reason, and
    # "auto" still loads (it falls back to AES-GCM)
    code = (
        "import sys; sys.modules['nacl._sodium'] = None\n"
        "from xdc.config import ConfigError, load_config\n"
        "assert load_config(None, env={}).tls.record_cipher == 'auto'\n"
        "try:\n"
        "    load_config(None, env={}, overrides={'tls.record_cipher': 'aegis-128l'})\n"
        "except ConfigError as e:\n"
        "    print('\\n'.join(e.problems))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert "tls.record_cipher: aegis-128l: PyNaCl is not installed" in out.stdout, out


def test_send_batch_chunks_is_bounded() -> None:
    assert load_config(None, env={}).sender.send_batch_chunks == 4
    for bad in ("0", "65", "-3", "x", "1e9"):
        with pytest.raises(ConfigError, match=r"sender\.send_batch_chunks"):
            load_config(None, env={"XDC_SENDER__SEND_BATCH_CHUNKS": bad})
    assert (
        load_config(None, env={"XDC_SENDER__SEND_BATCH_CHUNKS": "1"}).sender.send_batch_chunks == 1
    )


def test_a_sender_whose_chunks_its_own_limit_refuses_does_not_start(tmp_path: Path) -> None:
    """A sender whose every BEGIN its own limit refuses once crashed on its first request:
    it refuses to start, naming both values. A receiver may lower the limit below the
    default chunk: that config is fine for it."""
    f = tmp_path / "c.toml"
    f.write_text(
        f'[sender]\nchunk_bytes = {8 * 1024**2}\ncontrol_socket = "{tmp_path}/tx.sock"\n'
        f'[limits]\nmax_chunk_bytes = {1024**2}\n[tls]\nmode = "off"\n'
    )
    r = subprocess.run(
        [sys.executable, "-m", "xdc", "sender", "--config", str(f)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stderr
    assert "sender.chunk_bytes: 8388608 > limits.max_chunk_bytes 1048576" in r.stderr, r.stderr
    assert not (tmp_path / "tx.sock").exists()
    cfg = load_config(f, env={})  # loading it is fine: the receiver's side of it is valid
    assert cfg.limits.max_chunk_bytes == 1024**2
