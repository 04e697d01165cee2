"""tandem.spec_eagle: EAGLE speculative decoding that keeps the overlap (draft ->
verify -> publish -> draft-extend -> stash), plugged into the scheduler through its
speculative-worker interface; the scheduler never imports this package.

This layer is being built (see the spec-eagle issue); for now it only proves that it
installs in the shared ``tandem`` namespace.
"""

LAYER = "spec_eagle"
