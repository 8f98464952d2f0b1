"""``kvguard replay``: vLLM's real offload scheduler on a trace, with a simulated GPU worker.

Modules: :mod:`.trace` (the JSONL format, built-in traces under ``traces/``),
:mod:`.harness` (builds the real ``Scheduler`` + ``OffloadingConnector`` and runs a
trace), :mod:`.worker` (the simulated GPU side), :mod:`.report` (the ``--json`` object
and the text report), :mod:`.command` (the click command). Only ``harness`` and
``worker`` import vLLM, and only when a replay runs. See ``docs/replay.md``.
"""
