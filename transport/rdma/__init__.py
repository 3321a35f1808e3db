"""RDMA backend (pyverbs) for transfers inside one datacenter; optional.

Pure cores (QP-info codec, backend selection, immediate-data codec, writer and landing
bookkeeping) plus a thin trio shell (session.py). pyverbs is imported only when a real device
is opened; everything else runs, and is tested, without it (the fake fabric:
``xdc.lab.fake_verbs``).
"""

from xdc.transport.rdma.endpoint import RdmaEndpoint
from xdc.transport.rdma.imm import ImmCodec
from xdc.transport.rdma.landing import LandingZone
from xdc.transport.rdma.qpinfo import (
    QpInfo,
    QpInfoError,
    SlotGrant,
    decode_grant,
    decode_qpinfo,
    encode_grant,
    encode_qpinfo,
)
from xdc.transport.rdma.select import Backend, choose_backend, select_backend, usable_devices
from xdc.transport.rdma.session import RdmaReceiver, RdmaSender, exchange_qpinfo, next_completions
from xdc.transport.rdma.verbs import (
    Access,
    PyverbsBackend,
    RdmaLinkError,
    RdmaUnavailable,
    Verbs,
    VerbsError,
    load_pyverbs,
)
from xdc.transport.rdma.writer import RdmaWriter

__all__ = [
    "Access",
    "Backend",
    "ImmCodec",
    "LandingZone",
    "PyverbsBackend",
    "QpInfo",
    "QpInfoError",
    "RdmaEndpoint",
    "RdmaLinkError",
    "RdmaReceiver",
    "RdmaSender",
    "RdmaUnavailable",
    "RdmaWriter",
    "SlotGrant",
    "Verbs",
    "VerbsError",
    "choose_backend",
    "decode_grant",
    "decode_qpinfo",
    "encode_grant",
    "encode_qpinfo",
    "exchange_qpinfo",
    "load_pyverbs",
    "next_completions",
    "select_backend",
    "usable_devices",
]
