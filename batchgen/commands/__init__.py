"""The command line: `batchgen` runs a job; its subcommands plan, status, report, retry, finalize, view, head,
nightly, increment and help read or run one."""
