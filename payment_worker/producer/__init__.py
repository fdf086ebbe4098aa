"""The producer side: validate and submit batches (with enqueue dedup), and report status."""
