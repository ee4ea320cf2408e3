"""Imported (preloaded) by the reward workers' forkserver: it ignores SIGTERM there.

A SIGTERM sent to the whole job (Ray's job stop, a pod's shutdown) reaches the forkserver too;
if it died, multiprocessing would take its workers for dead (and no longer kill them), and
replace them all. The forkserver still exits when the parent does (its "alive" pipe closes).
Only the forkserver acts on it: the parent sets the variable just while starting it.
"""

import os
import signal

if os.environ.get("RLSCALE_REWARD_FORKSERVER") == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
