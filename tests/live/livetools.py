"""Helpers for the live tests: a tiny hybrid model, an offloading vLLM server, Prometheus.

Process handling, ports and waits are tests/e2e/e2etools.py's (reused, not rewritten).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import httpx
from e2etools import KVGUARD, SERVED_NAME, VLLM_SERVER, Proc, Server, base_env, free_port, wait_for
from prometheus_client.parser import text_string_to_metric_families

#: GPU block (tokens), set with --block-size: vLLM's CPU default is 128; CPU kernel
#: blocks are multiples of 32. The offloaded block (chunk) must be a multiple of it.
GPU_BLOCK_TOKENS = 32
OFFLOAD_BLOCK_TOKENS = 64
SLIDING_WINDOW = 96          # tokens
NUM_GPU_BLOCKS = 100         # --num-gpu-blocks-override: small enough that fillers evict P
MAX_MODEL_LEN = 1536         # tokens: fits the 100-block pool (vLLM checks one full-length request)
VOCAB = 512
SPEC_MODULE = "kvguard.guards.cpu_offloading"
SPEC_NAME = "CPUPlatformOffloadingSpec"


def make_tiny_hybrid(out: Path) -> Path:
    """A random-weight 2-layer Mistral whose layer 0 is sliding-window attention
    (``SLIDING_WINDOW`` tokens) and layer 1 full attention, so vLLM builds two KV cache
    groups. float32, head_dim 64 (the CPU attention kernel rejects 16), 1 KV head:
    512 bytes of KV per token per layer. Made locally with transformers (no hub)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import MistralConfig, MistralForCausalLM, PreTrainedTokenizerFast

    cfg = MistralConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        max_position_embeddings=4096, sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"], torch_dtype="float32",
    )
    torch.manual_seed(0)
    MistralForCausalLM(cfg).to(torch.float32).save_pretrained(out)
    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="w0", bos_token="w1", eos_token="w2", pad_token="w3"
    ).save_pretrained(out)
    return out


def kv_transfer_config(spec_name: str = SPEC_NAME, spec_module: str = SPEC_MODULE, **extra) -> str:
    """vLLM's ``--kv-transfer-config`` for the OffloadingConnector with a spec loaded by
    module path (vLLM imports it in every process)."""
    return json.dumps({
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": spec_name, "spec_module_path": spec_module,
            "cpu_bytes_to_use": 64 << 20, "block_size": OFFLOAD_BLOCK_TOKENS, **extra,
        },
    })


def offload_args(model: Path, port: int, transfer_config: str, num_gpu_blocks: int = NUM_GPU_BLOCKS,
                 max_model_len: int = MAX_MODEL_LEN, extra: tuple[str, ...] = ()) -> list[str]:
    """vLLM server argv: stats on (vLLM's /metrics needs them), eager, a small GPU-block
    pool (``num_gpu_blocks`` blocks of ``GPU_BLOCK_TOKENS`` tokens), offloading on."""
    return [
        *VLLM_SERVER, "--model", str(model), "--served-model-name", SERVED_NAME,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--max-model-len", str(max_model_len), "--max-num-seqs", "2", "--enforce-eager",
        "--num-gpu-blocks-override", str(num_gpu_blocks),
        "--block-size", str(GPU_BLOCK_TOKENS), "--disable-uvicorn-access-log",
        "--kv-transfer-config", transfer_config, *extra,
    ]


class LiveServer(Server):
    """e2etools.Server with the offloading argv: under ``kvguard run`` with the sidecar
    (``supervised``), or plain vLLM (``KVGUARD_DISABLE=1``) with extra environment."""

    def __init__(self, name: str, model: Path, workdir: Path, supervised: bool, transfer_config: str,
                 env_extra: dict[str, str] | None = None, grace: float = 30.0, **server_args) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.state_dir = workdir / "state"
        self.termination_log = workdir / "termination-log"
        self.termination_log.write_text("")
        env = {**base_env(), **(env_extra or {})}
        argv = offload_args(model, self.port, transfer_config, **server_args)
        if supervised:
            argv = [KVGUARD, "run", "--log-console", "--grace", str(grace), "--state-dir", str(self.state_dir),
                    "--termination-log", str(self.termination_log), "--", *argv]
        else:
            env["KVGUARD_DISABLE"] = "1"
        self.proc = Proc(name, argv, workdir / "server.log", env)
        self.sidecar = None
        self.sidecar_url = None
        if supervised:
            sport = free_port()
            self.sidecar_port = sport
            self.sidecar_url = f"http://127.0.0.1:{sport}"
            self.sidecar = Proc(
                name + "-sidecar",
                [KVGUARD, "sidecar", "--vllm-url", self.url, "--state-dir", str(self.state_dir),
                 "--host", "127.0.0.1", "--port", str(sport), "--poll-interval", "0.1",
                 "--health-timeout", "0.5", "--log-console"],
                workdir / "sidecar.log", base_env(),
            )
        self.ready_after = None

    def generate(self, prompt: list[int], max_tokens: int, cache_salt: str | None = None,
                 timeout: float = 300) -> dict:
        """Greedy completion of a token-id prompt; returns vLLM's choice (``text``,
        ``logprobs``) with ``usage``. ``cache_salt`` isolates the request's prefix
        cache (and offload keys): a fresh salt is a no-offload baseline."""
        body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "logprobs": 1, "ignore_eos": True}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        r = httpx.post(self.url + "/v1/completions", json=body, timeout=timeout)
        assert r.status_code == 200, r.text
        out = r.json()
        choice = out["choices"][0]
        choice["usage"] = out["usage"]
        return choice

    def vllm_metrics(self) -> dict[str, float]:
        """vLLM's own /metrics, summed over labels: ``{sample name: value}``."""
        r = httpx.get(self.url + "/metrics", timeout=10)
        assert r.status_code == 200
        return sum_samples(r.text)


def sum_samples(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


class Prometheus:
    """Debian's /usr/bin/prometheus (or ``$KVGUARD_PROMETHEUS``) on a loopback port, scraping the sidecar (job
    ``kvguard``) and vLLM (job ``vllm``) every second, with the project's alert rules."""

    def __init__(self, workdir: Path, rules: Path, sidecar: str, vllm: str) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = workdir / "prometheus.yml"
        cfg.write_text(json.dumps({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [
                {"job_name": "kvguard", "static_configs": [{"targets": [sidecar]}]},
                {"job_name": "vllm", "static_configs": [{"targets": [vllm]}]},
            ],
        }))
        binary = os.environ.get("KVGUARD_PROMETHEUS") or shutil.which("prometheus") or "/usr/bin/prometheus"
        assert os.access(binary, os.X_OK), (
            f"no Prometheus server at {binary}: scripts/ensure-tools.sh installs Debian's `prometheus` "
            "package (promtool and the server), or set KVGUARD_PROMETHEUS")
        self.proc = Proc("prometheus", [
            binary, f"--config.file={cfg}", f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ], workdir / "prometheus.log", base_env())

    def wait_ready(self, timeout: float = 60) -> None:
        def ready() -> bool:
            try:
                return httpx.get(self.url + "/-/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False
        wait_for(ready, timeout, "prometheus ready", interval=0.2, alive=self.proc.alive)

    def query(self, expr: str) -> list[dict]:
        r = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10)
        assert r.status_code == 200, (expr, r.text)
        body = r.json()
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def get(self, path: str) -> dict:
        r = httpx.get(self.url + path, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()["data"]

    def stop(self) -> None:
        self.proc.stop()

