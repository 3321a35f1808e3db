"""Profiles: what one instance type costs per request, and what requests look like.

The throughput model (``model.py``) needs four measured curves and one distribution: prefill
time and KV bytes by uncached length for each instance type, a decode rate for the PD type,
and the length distribution of requests. A profile file carries them so that the planner, the
router and the replay simulator all reason about the *same* hardware and workload.

Curves are small tables (a handful of profiled lengths) read by piecewise-linear interpolation
with linear extrapolation at both ends, clipped at zero: profiling runs measure a few lengths
and the model evaluates anywhere in between, including beyond the longest profiled prompt.

Expectations over the workload reduce to two functions, the CDF ``F(x) = P(L <= x)`` and the
partial first moment ``M(x) = E[L; L <= x]``; with those and piecewise-linear curves every
expectation the model needs is exact (closed form for the log-normal, exact sums for an
empirical list), so threshold searches see smooth curves instead of Monte-Carlo noise.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import statistics
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from xdc.errors import ConfigurationError
from xdc.textfile import UnreadableFile, read_text_file

FloatArray = npt.NDArray[np.float64]

MIB = 1024 * 1024
MAX_PROFILE_BYTES = 16 * MIB  # a profile is a few KiB (traces have their own, larger cap)
_SQRT2 = math.sqrt(2.0)
_erf = np.frompyfunc(math.erf, 1, 1)
# Interior thresholds a continuous workload's default search grid holds; the planner refines
# between neighbours, so this only needs to be fine enough to bracket the optimum.
_GRID_POINTS = 512
# Rejection sampling for the truncated log-normal is exact; below this acceptance rate it would
# waste too many draws, so sampling falls back to exact inverse-CDF draws one at a time.
_MIN_ACCEPTANCE = 0.05


class ProfileError(ConfigurationError, ValueError):
    """Every problem found in a profile, one per line, each naming its field."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid profile:\n  " + "\n  ".join(problems))


# --------------------------------------------------------------------------- interpolation


def interpolate(xs: Sequence[float], ys: Sequence[float], x: npt.ArrayLike) -> FloatArray:
    """Piecewise-linear through the table, extended linearly past both ends, never negative."""
    xa = np.asarray(xs, dtype=np.float64)
    ya = np.asarray(ys, dtype=np.float64)
    q = np.asarray(x, dtype=np.float64)
    y = np.interp(q, xa, ya)
    lo_slope = (ya[1] - ya[0]) / (xa[1] - xa[0])
    hi_slope = (ya[-1] - ya[-2]) / (xa[-1] - xa[-2])
    y = np.where(q < xa[0], ya[0] + lo_slope * (q - xa[0]), y)
    y = np.where(q > xa[-1], ya[-1] + hi_slope * (q - xa[-1]), y)
    out: FloatArray = np.maximum(y, 0.0)
    return out


@dataclass(frozen=True)
class Piece:
    """``f(x) = intercept + slope * x`` on ``lo < x <= hi``: one affine piece of a curve."""

    lo: float
    hi: float
    intercept: float
    slope: float


def linear_pieces(xs: Sequence[float], ys: Sequence[float]) -> tuple[Piece, ...]:
    """The curve ``interpolate(xs, ys, .)`` as affine pieces covering ``[0, inf)``.

    Expectations of a piecewise-linear function need only the workload's mass and first
    moment on each piece, so this decomposition is what makes them exact. Where the
    extrapolated line would go negative the piece is split and its negative part is zero.
    """
    bounds = [0.0, *(float(x) for x in xs), math.inf]
    pieces: list[Piece] = []
    n = len(xs)
    for i in range(len(bounds) - 1):
        lo, hi = bounds[i], bounds[i + 1]
        if hi <= lo:
            continue
        j = min(max(i - 1, 0), n - 2)  # table segment whose line covers this interval
        slope = (ys[j + 1] - ys[j]) / (xs[j + 1] - xs[j])
        intercept = ys[j] - slope * xs[j]
        root = -intercept / slope if slope != 0 else math.nan
        if lo < root < hi:
            # The line changes sign inside: the negative side is clipped to zero.
            zero_left = slope > 0
            pieces.append(
                Piece(lo, root, 0.0, 0.0) if zero_left else Piece(lo, root, intercept, slope)
            )
            pieces.append(
                Piece(root, hi, intercept, slope) if zero_left else Piece(root, hi, 0.0, 0.0)
            )
        else:
            probe = lo + 1.0 if math.isinf(hi) else (lo + hi) / 2
            negative = intercept + slope * probe < 0
            pieces.append(Piece(lo, hi, 0.0, 0.0) if negative else Piece(lo, hi, intercept, slope))
    return tuple(pieces)


# --------------------------------------------------------------------------- instance types


@dataclass(frozen=True)
class InstanceProfile:
    """One instance type (e.g. 8xH200 running the model): its profiled per-request costs.

    ``decode_rate_rps`` is how many requests per second one instance finishes decoding while
    meeting the decode SLO, i.e. ``BS_max / (T_decode * L_out)`` of eq. (5); zero for a type
    that only prefills.
    """

    name: str
    gpus: int
    lengths: tuple[int, ...]
    prefill_s: tuple[float, ...]
    kv_bytes: tuple[float, ...]
    decode_rate_rps: float = 0.0

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ProfileError(problems)

    def problems(self) -> list[str]:
        """Field-named problems; empty when the profile is usable."""
        p: list[str] = []
        if not self.name:
            p.append("name: must not be empty")
        if self.gpus < 1:
            p.append(f"gpus: must be >= 1, got {self.gpus}")
        n = len(self.lengths)
        if n < 2:
            p.append(f"lengths: need at least 2 profiled lengths, got {n}")
        elif any(x <= 0 for x in self.lengths):
            p.append("lengths: every length must be > 0")
        elif any(b <= a for a, b in zip(self.lengths, self.lengths[1:], strict=False)):
            p.append("lengths: must be strictly increasing")
        for fname in ("prefill_s", "kv_bytes"):
            values: tuple[float, ...] = getattr(self, fname)
            if len(values) != n:
                p.append(f"{fname}: has {len(values)} entries but lengths has {n}")
            elif not all(math.isfinite(v) and v >= 0 for v in values):
                p.append(f"{fname}: every entry must be finite and >= 0")
        if not (math.isfinite(self.decode_rate_rps) and self.decode_rate_rps >= 0):
            p.append(f"decode_rate_rps: must be finite and >= 0, got {self.decode_rate_rps}")
        return p

    def prefill_time(self, length: float) -> float:
        """Seconds one instance spends prefilling ``length`` uncached tokens."""
        return float(interpolate(self.lengths, self.prefill_s, length))

    def kv_size(self, length: float) -> float:
        """Bytes of KV cache a request of ``length`` uncached tokens ships to decode."""
        return float(interpolate(self.lengths, self.kv_bytes, length))

    def prefill_times(self, lengths: npt.ArrayLike) -> FloatArray:
        return interpolate(self.lengths, self.prefill_s, lengths)

    @cached_property
    def kv_pieces(self) -> tuple[Piece, ...]:
        return linear_pieces(self.lengths, self.kv_bytes)


# --------------------------------------------------------------------------- workload


def _norm_cdf(z: FloatArray) -> FloatArray:
    out: FloatArray = 0.5 * (1.0 + np.asarray(_erf(z / _SQRT2), dtype=np.float64))
    return out


def _safe_log(x: FloatArray) -> FloatArray:
    with np.errstate(divide="ignore"):
        out: FloatArray = np.log(np.maximum(x, 0.0))
    return out


@dataclass(frozen=True)
class ThresholdGrid:
    """Candidate thresholds with the workload's CDF and partial mean cached at each."""

    t: FloatArray
    cdf: FloatArray
    partial_mean: FloatArray


@dataclass(frozen=True)
class Workload:
    """Distribution of uncached input length ``L`` plus the mean output length.

    ``kind="lognormal"``: log-normal(mu, sigma) truncated (renormalised, not clipped) to
    ``[min_tokens, max_tokens]``; the paper's case study is of this form. ``kind="empirical"``:
    each listed length equally likely, e.g. the input lengths of a trace.
    """

    kind: Literal["lognormal", "empirical"]
    output_tokens: float
    mu: float = 0.0
    sigma: float = 0.0
    min_tokens: float = 0.0
    max_tokens: float = 0.0
    lengths: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ProfileError(problems)

    def problems(self) -> list[str]:
        p: list[str] = []
        if not (math.isfinite(self.output_tokens) and self.output_tokens > 0):
            p.append(f"output_tokens: must be > 0, got {self.output_tokens}")
        if self.kind == "lognormal":
            if not math.isfinite(self.mu):
                p.append(f"mu: must be finite, got {self.mu}")
            if not (math.isfinite(self.sigma) and self.sigma > 0):
                p.append(f"sigma: must be > 0, got {self.sigma}")
            if not (math.isfinite(self.min_tokens) and self.min_tokens > 0):
                p.append(f"min_tokens: must be > 0, got {self.min_tokens}")
            if not (math.isfinite(self.max_tokens) and self.max_tokens > self.min_tokens):
                p.append(
                    f"max_tokens: must be finite and > min_tokens ({self.min_tokens}), "
                    f"got {self.max_tokens}"
                )
            elif not p and self._log_mass <= 0:
                p.append("min_tokens/max_tokens: the range holds no probability mass")
        elif self.kind == "empirical":
            if not self.lengths:
                p.append("lengths: an empirical workload needs at least one length")
            elif any(x <= 0 for x in self.lengths):
                p.append("lengths: every length must be > 0")
        else:
            p.append(f"kind: must be 'lognormal' or 'empirical', got {self.kind!r}")
        return p

    # -- constructors

    @classmethod
    def lognormal(
        cls,
        mu: float,
        sigma: float,
        min_tokens: float,
        max_tokens: float,
        output_tokens: float,
    ) -> Workload:
        return cls(
            "lognormal",
            float(output_tokens),
            mu=float(mu),
            sigma=float(sigma),
            min_tokens=float(min_tokens),
            max_tokens=float(max_tokens),
        )

    @classmethod
    def empirical(cls, lengths: Iterable[int], output_tokens: float) -> Workload:
        return cls("empirical", float(output_tokens), lengths=tuple(int(x) for x in lengths))

    @classmethod
    def from_trace(
        cls,
        path: str | Path,
        output_tokens: float | None = None,
        *,
        prefix_cache: bool = False,
        block_tokens: int = 512,
    ) -> Workload:
        """Input lengths of a Mooncake jsonl trace (``input_length``, optional ``output_length``).

        With ``prefix_cache`` each request's length is its *uncached* part assuming an
        unbounded prefix cache: the leading ``hash_ids`` blocks already seen earlier in the
        trace are subtracted (``block_tokens`` per block), which is what the threshold acts
        on. ``output_tokens`` defaults to the trace's mean ``output_length``.
        """
        lengths: list[int] = []
        outputs: list[int] = []
        seen: set[int] = set()
        p = Path(path)
        try:
            text = read_text_file(p)
        except UnreadableFile as e:
            raise ProfileError([f"trace {path}: {e}"]) from None
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:  # a decode error, or an integer of over 4300 digits
                msg = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
                raise ProfileError([f"trace {path}:{lineno}: not valid JSON: {msg}"]) from None
            n_in = rec.get("input_length") if isinstance(rec, dict) else None
            if not isinstance(n_in, int) or isinstance(n_in, bool) or n_in < 0:
                raise ProfileError(
                    [f"trace {path}:{lineno}: input_length: expected an integer >= 0"]
                )
            n_out = rec.get("output_length")
            if isinstance(n_out, int) and not isinstance(n_out, bool):
                outputs.append(n_out)
            if prefix_cache:
                hashes = rec.get("hash_ids") or []
                hit = 0
                for h in hashes:
                    if h not in seen:
                        break
                    hit += 1
                seen.update(hashes)
                n_in = max(n_in - hit * block_tokens, 0)
            lengths.append(max(n_in, 1))
        if not lengths:
            raise ProfileError([f"trace {path}: no requests"])
        if output_tokens is None:
            if not outputs:
                raise ProfileError(
                    [f"trace {path}: output_length missing; set workload.output_tokens"]
                )
            output_tokens = statistics.fmean(outputs)
        return cls.empirical(lengths, output_tokens)

    # -- distribution functions (vectorised; every expectation is built on these two)

    @cached_property
    def _log_mass(self) -> float:
        z = np.array([math.log(self.min_tokens), math.log(self.max_tokens)]) - self.mu
        lo, hi = _norm_cdf(z / self.sigma)
        return float(hi - lo)

    @cached_property
    def _sorted(self) -> tuple[FloatArray, FloatArray]:
        xs = np.sort(np.asarray(self.lengths, dtype=np.float64))
        return xs, np.concatenate([[0.0], np.cumsum(xs)])

    def cdf(self, x: npt.ArrayLike) -> FloatArray:
        """P(L <= x)."""
        q = np.asarray(x, dtype=np.float64)
        if self.kind == "empirical":
            xs, _ = self._sorted
            out: FloatArray = np.searchsorted(xs, q, side="right") / len(xs)
            return out
        return self._lognormal_part(q, shift=0.0)

    def partial_mean(self, x: npt.ArrayLike) -> FloatArray:
        """E[L; L <= x], the first moment of the part of the distribution at or below x."""
        q = np.asarray(x, dtype=np.float64)
        if self.kind == "empirical":
            xs, csum = self._sorted
            out: FloatArray = csum[np.searchsorted(xs, q, side="right")] / len(xs)
            return out
        scale = math.exp(self.mu + self.sigma**2 / 2)
        return scale * self._lognormal_part(q, shift=self.sigma)

    def _lognormal_part(self, q: FloatArray, shift: float) -> FloatArray:
        # Truncated log-normal: F(x) uses Phi((ln x - mu)/sigma); E[L; L <= x] uses the same
        # with the argument shifted by sigma and a factor exp(mu + sigma^2/2).
        clipped = np.clip(q, self.min_tokens, self.max_tokens)
        z = (_safe_log(clipped) - self.mu) / self.sigma - shift
        z0 = (math.log(self.min_tokens) - self.mu) / self.sigma - shift
        base = _norm_cdf(np.asarray(z0, dtype=np.float64))
        out: FloatArray = (_norm_cdf(z) - base) / self._log_mass
        return out

    @property
    def min_length(self) -> float:
        return float(self._sorted[0][0]) if self.kind == "empirical" else self.min_tokens

    @property
    def max_length(self) -> float:
        return float(self._sorted[0][-1]) if self.kind == "empirical" else self.max_tokens

    @cached_property
    def mean(self) -> float:
        return float(self.partial_mean(math.inf))

    @cached_property
    def threshold_grid(self) -> ThresholdGrid:
        """Default interior thresholds for the planner, with F and M precomputed.

        Empirical: every distinct length (between two of them the split does not change).
        Log-normal: geometric spacing over ``(min, max)``; the planner refines between points.
        """
        if self.kind == "empirical":
            t = np.unique(self._sorted[0])[:-1]  # t >= the largest length offloads nothing
            if len(t) > 4 * _GRID_POINTS:
                t = np.unique(np.quantile(t, np.linspace(0, 1, 4 * _GRID_POINTS)))
        else:
            t = np.geomspace(self.min_tokens, self.max_tokens, _GRID_POINTS + 2)[1:-1]
        return ThresholdGrid(t=t, cdf=self.cdf(t), partial_mean=self.partial_mean(t))

    def samples(self, n: int, seed: int) -> FloatArray:
        """``n`` lengths drawn i.i.d. from the workload (deterministic for a given seed)."""
        rng = np.random.default_rng(seed)
        if self.kind == "empirical":
            out: FloatArray = rng.choice(self._sorted[0], size=n, replace=True)
            return out
        lo, hi = math.log(self.min_tokens), math.log(self.max_tokens)
        if self._log_mass >= _MIN_ACCEPTANCE:
            chunks: list[FloatArray] = []
            have = 0
            while have < n:
                z = rng.normal(self.mu, self.sigma, size=int((n - have) / self._log_mass) + 16)
                z = z[(z >= lo) & (z <= hi)]
                chunks.append(z)
                have += len(z)
            logs = np.concatenate(chunks)[:n] if chunks else np.zeros(0)
        else:
            nd = statistics.NormalDist(self.mu, self.sigma)
            u = rng.uniform(nd.cdf(lo), nd.cdf(hi), size=n)
            logs = np.array([nd.inv_cdf(min(max(v, 1e-300), 1 - 1e-16)) for v in u])
            logs = np.clip(logs, lo, hi)
        result: FloatArray = np.exp(logs)
        return result

    def describe(self) -> str:
        if self.kind == "empirical":
            return (
                f"empirical, {len(self.lengths)} lengths in [{self.min_length:.0f}, "
                f"{self.max_length:.0f}], mean {self.mean:.0f} tokens, "
                f"output {self.output_tokens:.0f} tokens"
            )
        return (
            f"log-normal mu={self.mu:g} sigma={self.sigma:g} truncated to "
            f"[{self.min_tokens:.0f}, {self.max_tokens:.0f}], mean {self.mean:.0f} tokens, "
            f"output {self.output_tokens:.0f} tokens"
        )


# --------------------------------------------------------------------------- whole profile

PD_CLUSTER = "pd"
DEFAULT_PRFAAS = "prfaas"
_CLUSTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class PrfaasCluster:
    """One PrfaaS cluster: its name (the source end of its link to the PD cluster, as the
    senders' ``node.cluster`` says), how many instances of the PrfaaS type it runs, and its
    egress link's capacity."""

    name: str
    instances: int
    egress_gbps: float


@dataclass(frozen=True)
class Profile:
    """A deployment: PrfaaS instance type and count, PD type and count, link, workload.

    ``homogeneous_instances`` sizes the homogeneous-PD baseline (all of the PD type); the
    paper compares against the same instance count (12) as PrfaaS + PD (4 + 8).

    Several PrfaaS clusters, each behind its own link, are listed in ``prfaas_clusters``; then
    ``n_prfaas`` and ``egress_gbps`` must be their totals (``profile_from_dict`` computes them).
    Without the list there is one PrfaaS cluster, named ``prfaas``. ``fleet`` gives the list
    either way.
    """

    prfaas: InstanceProfile
    pd: InstanceProfile
    n_prfaas: int
    n_pd: int
    egress_gbps: float
    workload: Workload
    homogeneous_instances: int
    prfaas_clusters: tuple[PrfaasCluster, ...] = ()

    @property
    def fleet(self) -> tuple[PrfaasCluster, ...]:
        """The PrfaaS clusters (one named ``prfaas`` unless the profile lists them)."""
        if self.prfaas_clusters:
            return self.prfaas_clusters
        return (PrfaasCluster(DEFAULT_PRFAAS, self.n_prfaas, self.egress_gbps),)

    def with_fleet(
        self,
        instances: Mapping[str, int] | None = None,
        egress_gbps: Mapping[str, float] | None = None,
    ) -> Profile:
        """The same deployment with some clusters' instance counts or link capacities changed
        (live figures for a replan); clusters not named keep theirs."""
        inst = instances or {}
        bw = egress_gbps or {}
        fleet = tuple(
            PrfaasCluster(c.name, int(inst.get(c.name, c.instances)), bw.get(c.name, c.egress_gbps))
            for c in self.fleet
        )
        return dataclasses.replace(
            self,
            prfaas_clusters=fleet if self.prfaas_clusters else (),
            n_prfaas=sum(c.instances for c in fleet),
            egress_gbps=sum(c.egress_gbps for c in fleet),
        )

    def __post_init__(self) -> None:
        p: list[str] = []
        if self.prfaas_clusters:
            names = [c.name for c in self.prfaas_clusters]
            for c in self.prfaas_clusters:
                if not _CLUSTER_NAME.match(c.name) or c.name == PD_CLUSTER:
                    p.append(
                        f"cluster.prfaas.name: {c.name!r} must match {_CLUSTER_NAME.pattern} "
                        f"and not be {PD_CLUSTER!r}"
                    )
                if c.instances < 0:
                    p.append(f"cluster.prfaas.{c.name}.instances: must be >= 0")
                if not (math.isfinite(c.egress_gbps) and c.egress_gbps >= 0):
                    p.append(f"cluster.prfaas.{c.name}.egress_gbps: must be finite and >= 0")
            if len(set(names)) != len(names):
                p.append(f"cluster.prfaas: duplicate cluster names in {names}")
            if self.n_prfaas != sum(c.instances for c in self.prfaas_clusters):
                p.append("cluster.n_prfaas: must equal the PrfaaS clusters' instances in total")
            if not math.isclose(
                self.egress_gbps, sum(c.egress_gbps for c in self.prfaas_clusters), rel_tol=1e-9
            ):
                p.append("cluster.egress_gbps: must equal the PrfaaS clusters' egress in total")
        if self.n_prfaas < 0:
            p.append(f"cluster.n_prfaas: must be >= 0, got {self.n_prfaas}")
        if self.n_pd < 1:
            p.append(f"cluster.n_pd: must be >= 1, got {self.n_pd}")
        if not (math.isfinite(self.egress_gbps) and self.egress_gbps >= 0):
            p.append(f"cluster.egress_gbps: must be finite and >= 0, got {self.egress_gbps}")
        if self.homogeneous_instances < 2:
            p.append(
                "cluster.homogeneous_instances: must be >= 2 (one prefill, one decode), "
                f"got {self.homogeneous_instances}"
            )
        if self.pd.decode_rate_rps <= 0:
            p.append("pd.decode_rate_rps: the PD instance type must decode (> 0)")
        if p:
            raise ProfileError(p)


# --------------------------------------------------------------------------- loading

_INSTANCE_KEYS = {
    "name",
    "gpus",
    "lengths",
    "prefill_s",
    "kv_bytes",
    "kv_mib",
    "decode_rate_rps",
    "bs_max",
    "t_decode_s",
}
_CLUSTER_KEYS = {"n_prfaas", "n_pd", "egress_gbps", "homogeneous_instances", "prfaas"}
_FLEET_KEYS = {"name", "instances", "egress_gbps"}
_WORKLOAD_KEYS = {
    "kind",
    "mu",
    "sigma",
    "min_tokens",
    "max_tokens",
    "lengths",
    "trace",
    "prefix_cache",
    "block_tokens",
    "output_tokens",
}


class _Reader:
    """Typed field access that records a field-named problem instead of raising."""

    def __init__(self, section: str, body: Mapping[str, Any], problems: list[str]) -> None:
        self.section = section
        self.body = body
        self.problems = problems

    def bad(self, key: str, msg: str) -> None:
        self.problems.append(f"{self.section}.{key}: {msg}")

    def has(self, key: str) -> bool:
        return key in self.body

    def num(self, key: str, default: float | None = None, *, integer: bool = False) -> float:
        if key not in self.body:
            if default is None:
                self.bad(key, "missing")
                return math.nan
            return default
        v = self.body[key]
        if isinstance(v, bool) or not isinstance(v, int | float):
            self.bad(key, f"expected a number, got {v!r}")
            return math.nan
        if integer and not float(v).is_integer():
            self.bad(key, f"expected an integer, got {v!r}")
            return math.nan
        if not math.isfinite(float(v)):
            self.bad(key, f"must be finite, got {v!r}")
            return math.nan
        return float(v)

    def nums(self, key: str) -> tuple[float, ...] | None:
        if key not in self.body:
            self.bad(key, "missing")
            return None
        v = self.body[key]
        if not isinstance(v, list) or not all(
            isinstance(x, int | float) and not isinstance(x, bool) for x in v
        ):
            self.bad(key, f"expected a list of numbers, got {v!r}")
            return None
        return tuple(float(x) for x in v)

    def text(self, key: str, default: str | None = None) -> str:
        v = self.body.get(key, default)
        if not isinstance(v, str):
            self.bad(key, "missing" if v is None else f"expected a string, got {v!r}")
            return ""
        return v

    def unknown(self, known: set[str]) -> None:
        for key in self.body:
            if key not in known:
                self.bad(key, f"unknown field; known: {', '.join(sorted(known))}")


def _section(data: Mapping[str, Any], name: str, problems: list[str]) -> Mapping[str, Any]:
    body = data.get(name)
    if body is None:
        problems.append(f"{name}: missing [{name}] table")
        return {}
    if not isinstance(body, dict):
        problems.append(f"{name}: expected a [{name}] table")
        return {}
    return body


def _instance(
    name: str, body: Mapping[str, Any], output_tokens: float, problems: list[str]
) -> InstanceProfile | None:
    r = _Reader(name, body, problems)
    r.unknown(_INSTANCE_KEYS)
    start = len(problems)
    label = r.text("name", default=name)
    gpus = r.num("gpus", integer=True)
    lengths = r.nums("lengths")
    prefill = r.nums("prefill_s")
    kv: tuple[float, ...] | None = None
    if r.has("kv_bytes") == r.has("kv_mib"):
        r.bad("kv_bytes", "give exactly one of kv_bytes or kv_mib")
    elif r.has("kv_bytes"):
        kv = r.nums("kv_bytes")
    else:
        mib = r.nums("kv_mib")
        kv = tuple(x * MIB for x in mib) if mib is not None else None
    rate = 0.0
    if r.has("decode_rate_rps"):
        if r.has("bs_max") or r.has("t_decode_s"):
            r.bad("decode_rate_rps", "give decode_rate_rps or bs_max + t_decode_s, not both")
        rate = r.num("decode_rate_rps")
    elif r.has("bs_max") or r.has("t_decode_s"):
        bs, step = r.num("bs_max"), r.num("t_decode_s")
        if step > 0 and bs >= 0 and output_tokens > 0:
            rate = bs / (step * output_tokens)  # eq. (5) per instance: BS_max / (T_dec * L_out)
        elif step <= 0:
            r.bad("t_decode_s", f"must be > 0, got {step:g}")
        elif bs < 0:
            r.bad("bs_max", f"must be >= 0, got {bs:g}")
    if lengths is not None and not all(float(x).is_integer() for x in lengths):
        r.bad("lengths", "every length must be a whole number of tokens")
    if len(problems) > start or lengths is None or prefill is None or kv is None:
        return None
    try:
        return InstanceProfile(
            name=label,
            gpus=int(gpus),
            lengths=tuple(int(x) for x in lengths),
            prefill_s=prefill,
            kv_bytes=kv,
            decode_rate_rps=rate,
        )
    except ProfileError as e:
        problems.extend(f"{name}.{m}" for m in e.problems)
        return None


def _workload(body: Mapping[str, Any], base: Path, problems: list[str]) -> Workload | None:
    r = _Reader("workload", body, problems)
    r.unknown(_WORKLOAD_KEYS)
    start = len(problems)
    kind = r.text("kind", default="trace" if "trace" in body else "lognormal")
    out: float | None = None  # a trace brings its own mean output length
    if kind != "trace" or r.has("output_tokens"):
        out = r.num("output_tokens")
    try:
        if kind == "lognormal":
            vals = [r.num(k) for k in ("mu", "sigma", "min_tokens", "max_tokens")]
            if len(problems) == start:
                mu, sigma, lo, hi = vals
                return Workload.lognormal(mu, sigma, lo, hi, output_tokens=float(out or 0))
        elif kind == "empirical":
            lengths = r.nums("lengths")
            if lengths is not None and len(problems) == start:
                return Workload.empirical((int(x) for x in lengths), float(out or 0))
        elif kind == "trace":
            path = Path(r.text("trace"))
            cache = body.get("prefix_cache", False)
            if not isinstance(cache, bool):
                r.bad("prefix_cache", f"expected true or false, got {cache!r}")
            block = r.num("block_tokens", 512.0, integer=True)
            if block < 1:
                r.bad("block_tokens", f"must be >= 1, got {block:g}")
            if len(problems) == start:
                return Workload.from_trace(
                    path if path.is_absolute() else base / path,
                    out,
                    prefix_cache=bool(cache),
                    block_tokens=int(block),
                )
        else:
            r.bad("kind", f"expected 'lognormal', 'empirical' or 'trace', got {kind!r}")
    except ProfileError as e:
        problems.extend(m if m.startswith("trace ") else f"workload.{m}" for m in e.problems)
    return None


def profile_from_dict(data: Mapping[str, Any], base_dir: str | Path = ".") -> Profile:
    """Build a Profile from parsed TOML/JSON; raise ProfileError listing every problem."""
    problems: list[str] = []
    for key in data:
        if key not in ("prfaas", "pd", "cluster", "workload"):
            problems.append(f"{key}: unknown table; known: cluster, pd, prfaas, workload")
    workload = _workload(_section(data, "workload", problems), Path(base_dir), problems)
    out_tokens = workload.output_tokens if workload is not None else math.nan
    prfaas = _instance("prfaas", _section(data, "prfaas", problems), out_tokens, problems)
    pd = _instance("pd", _section(data, "pd", problems), out_tokens, problems)
    c = _Reader("cluster", _section(data, "cluster", problems), problems)
    c.unknown(_CLUSTER_KEYS)
    fleet = _fleet(c, problems)
    if fleet:
        n_prfaas = float(sum(f.instances for f in fleet))
        egress = sum(f.egress_gbps for f in fleet)
    else:
        n_prfaas = c.num("n_prfaas", integer=True)
        egress = c.num("egress_gbps")
    n_pd = c.num("n_pd", integer=True)
    homo = c.num("homogeneous_instances", n_prfaas + n_pd, integer=True)
    if problems or prfaas is None or pd is None or workload is None:
        raise ProfileError(problems or ["profile: incomplete"])
    return Profile(
        prfaas=prfaas,
        pd=pd,
        n_prfaas=int(n_prfaas),
        n_pd=int(n_pd),
        egress_gbps=egress,
        workload=workload,
        homogeneous_instances=int(homo),
        prfaas_clusters=fleet,
    )


def _fleet(c: _Reader, problems: list[str]) -> tuple[PrfaasCluster, ...]:
    """``[[cluster.prfaas]]`` tables (name, instances, egress_gbps): several PrfaaS clusters,
    each behind its own link. They replace cluster.n_prfaas and cluster.egress_gbps."""
    if not c.has("prfaas"):
        return ()
    raw = c.body["prfaas"]
    if not isinstance(raw, list) or not raw or not all(isinstance(x, dict) for x in raw):
        c.bad("prfaas", "expected one or more [[cluster.prfaas]] tables")
        return ()
    for k in ("n_prfaas", "egress_gbps"):
        if c.has(k):
            c.bad(k, "give either this or [[cluster.prfaas]] tables (they sum them), not both")
    out: list[PrfaasCluster] = []
    for i, body in enumerate(raw):
        r = _Reader(f"cluster.prfaas[{i}]", body, problems)
        r.unknown(_FLEET_KEYS)
        start = len(problems)
        name = r.text("name")
        n = r.num("instances", integer=True)
        bw = r.num("egress_gbps")
        if len(problems) == start:
            out.append(PrfaasCluster(name, int(n), bw))
    return tuple(out)


def load_profile(path: str | Path) -> Profile:
    """Read a profile from TOML (or JSON, by ``.json`` suffix); ProfileError names bad fields.

    Relative trace paths are resolved against the profile file's directory.
    """
    p = Path(path)
    data = read_profile_data(p)
    try:
        return profile_from_dict(data, p.parent)
    except ProfileError as e:
        raise ProfileError([f"{path}: {m}" for m in e.problems]) from None


def read_profile_data(path: str | Path) -> dict[str, Any]:
    """A profile file's tables as parsed (TOML, or JSON by suffix), not yet checked: what a
    tool that rewrites part of a profile starts from. ProfileError when it cannot be read."""
    p = Path(path)
    try:
        text = read_text_file(p, MAX_PROFILE_BYTES)
    except UnreadableFile as e:
        raise ProfileError([f"profile {path}: {e}"]) from None
    try:
        data: Any = json.loads(text) if p.suffix.lower() == ".json" else tomllib.loads(text)
    except ValueError as e:  # a decode error, or an integer of over 4300 digits
        fmt = "JSON" if p.suffix.lower() == ".json" else "TOML"
        raise ProfileError([f"profile {path}: not valid {fmt}: {e}"]) from None
    if not isinstance(data, dict):
        raise ProfileError([f"profile {path}: top level must be a table/object"])
    return data
