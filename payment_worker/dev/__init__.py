"""Development and demo tooling: the gateway simulator, a local cluster of processes, the
demo, synthetic batches and the ledger reconciliation. Runtime code never imports this."""
