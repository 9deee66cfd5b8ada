"""batchgen: offline batch generation for LLMs, streamed from datasets into resumable Parquet parts."""

__version__ = "0.1.0"
