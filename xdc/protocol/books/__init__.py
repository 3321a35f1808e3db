"""The daemons' request books, sans-IO: what a request may do next on each side (the
lifecycle state machines, which answer with effects) and the bookkeeping they use (the
chunk grid of a request, which chunks were sent, landed and acknowledged)."""
