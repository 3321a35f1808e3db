"""The gateway and `xdc up`: plans, HTTP, failures and recovery, decode nodes, the differential
end-to-end test."""
