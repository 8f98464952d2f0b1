"""kvguard's in-process half: invariant guards for vLLM's CPU KV offloading path.

vLLM loads :func:`kvguard.guards.plugin.register` through the ``vllm.general_plugins`` entry
point in every vLLM process. Nothing is imported here at top level, so loading the
package costs nothing and never imports vLLM.
"""
