"""batchgen's Hydra config: config.yaml (the root), the groups (dataset/, engine/, sampling/, launcher/) and the job
presets (job/), with reference.md documenting every key. Edited here, at the top of the checkout; installed inside
the package as `batchgen.conf` (setup.py maps it), so the presets ship with every wheel and work from any directory."""
