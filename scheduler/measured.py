"""A profile from measurements: what ``xdc profile measure`` saw, turned into the ``[prfaas]``
and ``[pd]`` tables the router, ``xdc plan`` and ``xdc replay`` read.

Pure: samples in, a profile mapping (and its TOML text) out. The engines are driven in
``profile_measure_cli``; this module decides what the samples mean, so the reduction is
tested without an engine.

What is measured and how it maps onto the PrfaaS model (paper section 3):

- prefill time vs uncached length: the engine's time to first token for a prompt of that
  many tokens that no cache holds (``max_tokens`` 1, streamed), the median of the repeats.
  It includes the HTTP and tokenizer-free request path the gateway also pays.
- decode: the step time (the gap between consecutive tokens of one stream, median) with
  ``b`` streams decoding together, for each batch size swept. The largest batch swept is
  ``bs_max`` and its step time ``t_decode_s``, so eq. (5) gives the decode rate
  ``bs_max / (t_decode_s * output_tokens)``.
- KV bytes per token: what the operator gives (or the base profile's curve); xdc's own
  transfers are the place to measure it, and this module only scales it by length.
- the link: the capacity and RTT the sender's monitor reports (its ``/status``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xdc.scheduler.profile import Profile, ProfileError, profile_from_dict

from xdc.config import toml_value


@dataclass(frozen=True)
class PrefillSample:
    """One request's time to first token at ``length`` uncached tokens."""

    length: int
    ttft_s: float


@dataclass(frozen=True)
class DecodeSample:
    """The median gap between tokens of one stream while ``batch`` streams decoded together."""

    batch: int
    step_s: float


@dataclass(frozen=True)
class KvSample:
    """The KV cache one prompt of ``length`` tokens moved through xdc: ``bytes`` as the
    receiver delivered it (every layer's buffer), claimed from the receiver's engine socket."""

    length: int
    bytes: int


def kv_curve(samples: Sequence[KvSample]) -> dict[int, float]:
    """Median bytes moved per length swept, in increasing length."""
    by: dict[int, list[float]] = {}
    for s in samples:
        by.setdefault(s.length, []).append(float(s.bytes))
    return {n: statistics.median(v) for n, v in sorted(by.items())}


@dataclass(frozen=True)
class EngineMeasurement:
    """Everything measured on one engine (one instance type)."""

    url: str
    model: str
    prefill: tuple[PrefillSample, ...]
    decode: tuple[DecodeSample, ...]
    kv: tuple[KvSample, ...] = ()  # the transfers its prompts made through xdc, if any

    def prefill_medians(self) -> dict[int, float]:
        """Median time to first token per length swept, in increasing length."""
        by: dict[int, list[float]] = {}
        for s in self.prefill:
            by.setdefault(s.length, []).append(s.ttft_s)
        return {n: statistics.median(v) for n, v in sorted(by.items())}

    def step_medians(self) -> dict[int, float]:
        """Median decode step time per batch size swept, in increasing batch."""
        by: dict[int, list[float]] = {}
        for s in self.decode:
            by.setdefault(s.batch, []).append(s.step_s)
        return {b: statistics.median(v) for b, v in sorted(by.items())}


@dataclass(frozen=True)
class LinkMeasurement:
    """The PrfaaS -> PD link as the sender's monitor reports it."""

    capacity_bps: float
    rtt_ms: float | None
    source: str  # the monitor's capacity_source ("configured" or "measured"), or "flag"


def instance_table(
    m: EngineMeasurement,
    name: str,
    gpus: int,
    kv_bytes_per_token: float,
    kv_moved: Mapping[int, float] | None = None,
) -> dict[str, Any]:
    """The ``[prfaas]`` / ``[pd]`` table for one measured engine. KV sizes are the bytes
    really moved per length (``kv_moved``, from ``kv_curve``) where given, else
    ``kv_bytes_per_token`` x length.

    ValueError when the measurement cannot make a profile: fewer than two lengths, times
    that do not grow with length by more than the noise allows, no decode sample."""
    pre = m.prefill_medians()
    if len(pre) < 2:
        raise ValueError(f"{name}: {len(pre)} prefill length(s) measured; a profile needs 2+")
    if any(not (t > 0 and math.isfinite(t)) for t in pre.values()):
        raise ValueError(f"{name}: a prefill time is not a positive number: {pre}")
    steps = m.step_medians()
    if not steps:
        raise ValueError(f"{name}: no decode step measured")
    lengths = list(pre)
    if kv_moved is not None:
        missing = [n for n in lengths if not kv_moved.get(n, 0) > 0]
        if missing:
            raise ValueError(f"{name}: no KV transfer measured at {missing} tokens")
        kv_bytes = [round(kv_moved[n]) for n in lengths]
    elif kv_bytes_per_token > 0:
        kv_bytes = [round(n * kv_bytes_per_token) for n in lengths]
    else:
        raise ValueError(f"{name}: kv bytes per token must be > 0, got {kv_bytes_per_token}")
    times = monotone([pre[n] for n in lengths])
    bs_max = max(steps)
    return {
        "name": name,
        "gpus": gpus,
        "lengths": lengths,
        "prefill_s": [round(t, 6) for t in times],
        "kv_bytes": kv_bytes,
        "bs_max": bs_max,
        "t_decode_s": round(steps[bs_max], 6),
    }


def monotone(times: Sequence[float]) -> list[float]:
    """Prefill times made non-decreasing in length (a running maximum): a longer prompt never
    takes less, and a repeat that came out faster at a longer length is noise the planner
    must not read as a cheaper prompt."""
    out: list[float] = []
    for t in times:
        out.append(max(t, out[-1]) if out else t)
    return out


CLUSTER_COUNTS = ("n_prfaas", "n_pd", "homogeneous_instances")
"""The [cluster] counts a measurement may set: the measured system's shape, which the base
profile (a declaration of some other system) does not know."""


def with_cluster(
    base: Mapping[str, Any], base_dir: Path, counts: Mapping[str, int]
) -> tuple[dict[str, Any], Profile]:
    """The base profile with [cluster] counts replaced (``CLUSTER_COUNTS`` only), as data and
    as the router would load it. ProfileError if it does not load, before any engine is
    measured."""
    unknown = sorted(set(counts) - set(CLUSTER_COUNTS))
    if unknown:
        raise ProfileError([f"cluster: cannot set {', '.join(unknown)} from a measurement"])
    out: dict[str, Any] = {k: dict(v) if isinstance(v, Mapping) else v for k, v in base.items()}
    out["cluster"] = {**out.get("cluster", {}), **counts}
    return out, profile_from_dict(out, base_dir)


def measured_profile(
    base: Mapping[str, Any],
    base_dir: Path,
    prfaas: dict[str, Any],
    pd: dict[str, Any],
    link: LinkMeasurement | None,
) -> dict[str, Any]:
    """The base profile with its instance tables replaced by measured ones and, for a
    single link, its egress by the measured capacity. A workload trace path is made absolute
    so the file reads the same wherever it is written. ProfileError if the result does not
    load."""
    out: dict[str, Any] = {k: dict(v) if isinstance(v, Mapping) else v for k, v in base.items()}
    out["prfaas"], out["pd"] = prfaas, pd
    cluster = dict(out.get("cluster", {}))
    if link is not None:
        if "prfaas" in cluster:
            raise ProfileError(
                [
                    "cluster.prfaas: the base profile has several links; give each its own "
                    "measurement (one --sender per link is not supported yet)"
                ]
            )
        cluster["egress_gbps"] = round(link.capacity_bps / 1e9, 6)
    out["cluster"] = cluster
    workload = dict(out.get("workload", {}))
    trace = workload.get("trace")
    if isinstance(trace, str) and not Path(trace).is_absolute():
        workload["trace"] = str((base_dir / trace).resolve())
    out["workload"] = workload
    profile_from_dict(out, base_dir)  # it must load as written
    return out


def render_toml(profile: Mapping[str, Any], header: Sequence[str]) -> str:
    """The profile as TOML (tables of scalars and arrays, ``[[cluster.prfaas]]`` arrays of
    tables), with ``header`` lines as comments on top."""
    lines = [f"# {h}" if h else "#" for h in header]
    for section in ("cluster", "prfaas", "pd", "workload"):
        body = profile.get(section)
        if not isinstance(body, Mapping):
            continue
        lines += ["", f"[{section}]"]
        tables: list[tuple[str, list[Mapping[str, Any]]]] = []
        for key, value in body.items():
            if isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
                tables.append((key, value))
            else:
                lines.append(f"{key} = {_value(value)}")
        for key, rows in tables:
            for row in rows:
                lines += ["", f"[[{section}.{key}]]"]
                lines += [f"{k} = {_value(v)}" for k, v in row.items()]
    return "\n".join(lines) + "\n"


def _value(value: object) -> str:
    if isinstance(value, list):
        return toml_value(tuple(value))
    return toml_value(value)
