"""`python -m tensormorph.cli`, as the examples run it."""

from . import main

main()
