"""The speculative-decoding interface the runner drives, and the registry of algorithms."""
