"""The RDMA path: verbs over the fake fabric and real pyverbs, writer, sessions, the daemons over
RDMA."""
