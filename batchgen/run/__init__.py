"""Executing a job: the local runner, the feed of parts through the engine, pre-flight checks, progress, signals,
the Ray launcher."""
