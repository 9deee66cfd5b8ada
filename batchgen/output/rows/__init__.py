"""A part's rows, before they are a file: the output's columns and their types (schema.py), results made into
output rows (assemble.py; task=decide's in decide.py) and the part's counts (stats.py). Knows records and Arrow
types; the committer (output/committer.py) writes what these make."""
