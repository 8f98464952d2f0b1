"""kvguard's offline lab: ``kvguard replay`` (vLLM's real scheduler and connector over a
simulated worker, :mod:`kvguard.lab.replay`), ``kvguard fuzz`` (:mod:`kvguard.lab.fuzz`),
the source-only release matrix (:mod:`kvguard.lab.release_matrix`) and ``check-geometry``
(:mod:`kvguard.lab.geometry`). Nothing that runs inside vLLM imports it: the plugin is
:mod:`kvguard.guards`."""
