"""``kvguard fuzz``: search vLLM's offload scheduler for crash, stall and wrong-KV classes.

- :mod:`.strategies`: Hypothesis strategies that generate :class:`~kvguard.lab.replay.trace.Trace`
  objects (geometry, traffic), named after vLLM's terms;
- :mod:`.classes`: what a replay's outcome is (engine death, stall, wrong KV, kvguard action)
  and the stable class name of each finding;
- :mod:`.shrink`: delta debugging of a trace that keeps one class;
- :mod:`.runner`: runs examples on the installed vLLM's real scheduler and builds the report;
- :mod:`.plant`: the test-only planted kvguard fault;
- :mod:`.command`: the ``kvguard fuzz`` CLI.
"""
