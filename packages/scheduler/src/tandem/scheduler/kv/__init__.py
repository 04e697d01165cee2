"""KV memory: the row and page pools, the radix cache, per-request resources and the page ledger."""
