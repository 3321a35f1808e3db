"""`xdc config example`: generated from the dataclasses, every field documented, loadable."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from xdc.config import Config, NodeConfig, load_config, toml_value
from xdc.config_example import (
    DOCS,
    ROLES,
    field_docs,
    render_example,
    sections_for,
    undocumented,
)


def _all_fields() -> set[str]:
    cfg = Config()
    return {
        f"{s.name}.{f.name}"
        for s in dataclasses.fields(cfg)
        for f in dataclasses.fields(getattr(cfg, s.name))
    }


def test_every_config_field_is_documented() -> None:
    # A new field in xdc/config.py fails here until it gets a DOCS entry (or a comment above it).
    assert undocumented() == []
    assert set(field_docs()) == _all_fields()
    stale = set(DOCS) - _all_fields()
    assert not stale, f"DOCS entries for fields that no longer exist: {sorted(stale)}"


@dataclass
class _Knobs:
    """A section the docs table has never heard of."""

    # explained above the field
    commented: int = 1
    bare: float = 2.0
    beside: str = ""  # explained beside the field


@dataclass
class _WithNewSection:
    node: NodeConfig = field(default_factory=NodeConfig)
    knobs: _Knobs = field(default_factory=_Knobs)


def test_undocumented_field_is_detected_and_source_comments_count() -> None:
    docs = field_docs(_WithNewSection())  # type: ignore[arg-type]
    assert docs["knobs.bare"] is None
    assert docs["knobs.commented"] == "explained above the field"
    assert docs["knobs.beside"] == "explained beside the field"
    assert docs["node.id"] == DOCS["node.id"]


@pytest.mark.parametrize("role", ROLES)
def test_example_lists_every_field_of_its_sections_and_loads_as_defaults(
    role: str, tmp_path: Path
) -> None:
    text = render_example(role)
    data = tomllib.loads(text)
    assert list(data) == sections_for(role)
    cfg = Config()
    for name, body in data.items():
        assert set(body) == {f.name for f in dataclasses.fields(getattr(cfg, name))}, name
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if " = " in line and not line.startswith("#"):
            assert lines[i - 1].startswith("# ") and "(undocumented)" not in lines[i - 1], line
    path = tmp_path / f"{role}.toml"
    path.write_text(text)
    assert load_config(path, env={}) == Config()


def test_roles_pick_the_sections_their_daemon_reads() -> None:
    assert "router" not in sections_for("sender") and "monitor" in sections_for("sender")
    assert "sender" not in sections_for("receiver") and "receiver" in sections_for("receiver")
    assert sections_for("router")[0] == "node" and "tls" not in sections_for("router")
    assert sections_for("all") == [f.name for f in dataclasses.fields(Config)]
    with pytest.raises(ValueError):
        sections_for("decoder")


def test_toml_values_round_trip() -> None:
    for value in [
        'we"ird\\id\n\t\u00e9\x01\x7f\U0001f600',
        "",
        0,
        -3,
        17_179_869_184,
        0.002,
        1e-9,
        1e300,
    ]:
        assert tomllib.loads(f"v = {toml_value(value)}")["v"] == value
    assert tomllib.loads(f"v = {toml_value(True)}")["v"] is True
    assert tomllib.loads(f"v = {toml_value(float('inf'))}")["v"] == float("inf")
    with pytest.raises(TypeError):
        toml_value([1])


def test_cli_prints_role_example() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "xdc", "config", "example", "--role", "router"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    assert list(tomllib.loads(r.stdout)) == ["node", "router"]
