"""The GPU check: `python -m bench.gpu` (`cli`; `bench/gpu.sh` on a bare GPU machine) and its hand-over
measurement (`handover`)."""
