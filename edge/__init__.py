"""edge: an inference daemon for embedded boxes (OCR, inspection and Q&A over MQTT v5)."""

import os

__version__ = "0.1.0"

# How long an idle GNU OpenMP worker spins before it sleeps (torch's pool and our CPU
# kernels' alike), read when each OpenMP library loads: so here, before anything imports
# torch. At the default (300,000 turns) idle workers kept spinning beside the daemon's
# other threads and pools, and one sequence's decode through the daemon ran at 0.72x the
# same engine's own loop (58-66 tok/s between runs, 46 in the worst); at 10,000 turns it
# ran at the loop's rate, which lost nothing at two threads (a sleeping wait,
# OMP_WAIT_POLICY=PASSIVE, made the two-thread step 2.5x slower). A value set outside wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
