"""The command line: `batchgen` and each subcommand (plan, status, report, retry, finalize)."""
