"""Set-up, demo and sample generators, run from the repository root as `python -m scripts.<name>`."""
