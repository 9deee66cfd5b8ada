"""`python -m batchgen` is the same command as `batchgen`."""

from batchgen.commands.cli import main

if __name__ == "__main__":
    main()
