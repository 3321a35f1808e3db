"""The lab: what `xdc demo`, `xdc up`, `xdc bench` and the tests need to stand a system up
and load it (emulated links, load generators, a fake RDMA fabric, a tiny vLLM test model).
None of it is on the data path of a deployment."""
