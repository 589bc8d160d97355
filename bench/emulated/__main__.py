"""`python -m bench.emulated`: see `cli`."""
import sys

from bench.emulated.cli import main

sys.exit(main())
