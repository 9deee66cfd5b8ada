"""What earlier runs committed, read back as a ledger: the ids a run may skip (run.skip_existing over an output or a
root of nights) and the nights under a root, each found where the root is now. Reads outputs; writes none."""
