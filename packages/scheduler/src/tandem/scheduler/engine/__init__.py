"""The ``Engine`` and what runs it: the loop thread, intake, result delivery, wiring,
process setup (follower ranks, the allocator, the collector) and the CLI."""
