"""Pure domain code, no I/O: statuses, the transaction state machine, retry timing, stable
identities (idempotency keys, fingerprints), the payment request and the batch schema."""
