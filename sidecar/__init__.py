"""kvguard's out-of-process half: the metrics/health sidecar and ``kvguard run``.

Never imports vLLM (a test enforces it): the sidecar image carries no vLLM or torch.
"""
