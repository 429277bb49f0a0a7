"""`python -m mismatch_replay` runs the command line."""

from .cli import main

main()
