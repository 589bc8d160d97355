"""`python -m bench.gpu`: see `cli`."""
import sys

from bench.gpu.cli import main

sys.exit(main())
