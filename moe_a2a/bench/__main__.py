"""`python -m moe_a2a.bench ...` is `moe-a2a bench ...`."""
import sys

from ..cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
