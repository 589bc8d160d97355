"""`python -m tools.cluster`: build, shape, run on and tear down an emulated cluster."""
from . import main

main()
