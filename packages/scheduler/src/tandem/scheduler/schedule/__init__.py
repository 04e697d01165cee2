"""The host-only policy: which requests run in the next batch, and what their results do.

Nothing here imports the runner, the models, attention or the kernels: the policy talks
to the runner through ``messages.Runner`` and the batch messages."""
