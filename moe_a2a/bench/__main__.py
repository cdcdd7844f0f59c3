"""`python -m moe_a2a.bench ...` is `moe-a2a bench ...`."""
import sys

from .main import main

sys.exit(main(sys.argv[1:]))
