"""`python -m testbed.cluster`: build, shape, run on and tear down an emulated cluster."""
from .cli import main

main()
