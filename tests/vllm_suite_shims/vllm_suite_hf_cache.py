"""Shim 1 of the vLLM-suite comparison (issue 5): a local Hugging Face cache entry.

vLLM's offloading connector unit tests build ``ModelConfig(model="facebook/opt-125m")``
(``tests/v1/kv_connector/unit/utils.py::create_vllm_config``). ``ModelConfig`` only reads
the model's *configuration* (architecture, dtype, context length, generation defaults);
no weight and no tokenizer file is opened by the scheduler-side tests. On a machine
without a model hub, every such test fails in ``ModelConfig.__post_init__``.

This module writes what the hub would have put in ``$HF_HOME/hub`` for that model, in
huggingface_hub's own cache layout, so the tests run with ``HF_HUB_OFFLINE=1``::

    $HF_HOME/hub/models--facebook--opt-125m/
        refs/main                          "<revision>" (40 hex digits, no newline)
        blobs/<sha256 of the file>         the file's bytes
        snapshots/<revision>/config.json   relative symlink to ../../blobs/<sha256>

The values are OPT-125m's published architecture (``OPTConfig`` for 125m parameters:
12 layers, 12 heads, hidden 768, FFN 3072, vocabulary 50272, 2048 positions, float16),
the same ``config.json`` the hub serves. ``<revision>`` is *not* the hub's commit id: it
is derived from the files' bytes (``local_revision``), so the entry is reproducible and
cannot be mistaken for a download.

Stdlib only (the light test imports it without vLLM).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MODEL_ID = "facebook/opt-125m"

# facebook/opt-125m config.json, as published on the hub (OPTConfig, 125m parameters).
OPT_125M_CONFIG: dict[str, object] = {
    "_name_or_path": "facebook/opt-125m",
    "activation_dropout": 0.0,
    "activation_function": "relu",
    "architectures": ["OPTForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 2,
    "do_layer_norm_before": True,
    "dropout": 0.1,
    "eos_token_id": 2,
    "ffn_dim": 3072,
    "hidden_size": 768,
    "init_std": 0.02,
    "layerdrop": 0.0,
    "max_position_embeddings": 2048,
    "model_type": "opt",
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "pad_token_id": 1,
    "prefix": "</s>",
    "torch_dtype": "float16",
    "transformers_version": "4.21.0.dev0",
    "use_cache": True,
    "vocab_size": 50272,
    "word_embed_proj_dim": 768,
}

# Only config.json: measured on vLLM 0.33.0, ModelConfig needs nothing else for these tests.
# Without generation_config.json, vLLM/transformers derive the generation defaults from
# config.json (the same bos/eos/pad token ids the hub's file holds), and no tokenizer
# file is read because the scheduler-side tests never build a tokenizer.
OPT_125M_FILES: dict[str, dict[str, object]] = {"config.json": OPT_125M_CONFIG}


def repo_folder_name(model_id: str) -> str:
    """``"facebook/opt-125m"`` -> ``"models--facebook--opt-125m"`` (huggingface_hub's rule)."""
    return "models--" + model_id.replace("/", "--")


def file_bytes(content: dict[str, object]) -> bytes:
    """Serialise one JSON file as the hub stores it (2-space indent, trailing newline)."""
    return (json.dumps(content, indent=2, sort_keys=True) + "\n").encode()


def local_revision(files: dict[str, bytes]) -> str:
    """A 40-hex-digit revision id derived from the files (name and bytes, sorted by name).

    Deterministic: the same files give the same id on every machine. Not a hub commit.
    """
    digest = hashlib.sha1()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + files[name] + b"\0")
    return digest.hexdigest()


def write_hf_cache_entry(
    hf_home: Path,
    model_id: str = MODEL_ID,
    files: dict[str, dict[str, object]] | None = None,
) -> Path:
    """Write one model's cache entry under ``hf_home/hub``; return its snapshot folder.

    Idempotent: rewriting the same files leaves the same tree. ``files`` maps a file name
    in the repo to its JSON content (default: OPT-125m's ``config.json``). Raises ``OSError`` if ``hf_home`` cannot be written.
    """
    contents = {name: file_bytes(value) for name, value in (files or OPT_125M_FILES).items()}
    revision = local_revision(contents)
    repo = Path(hf_home) / "hub" / repo_folder_name(model_id)
    snapshot = repo / "snapshots" / revision
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, data in contents.items():
        blob_name = hashlib.sha256(data).hexdigest()
        blob = repo / "blobs" / blob_name
        if not blob.exists() or blob.read_bytes() != data:
            tmp = blob.with_suffix(".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, blob)
        link = snapshot / name
        target = os.path.join("..", "..", "blobs", blob_name)
        if link.is_symlink() or link.exists():
            if link.is_symlink() and os.readlink(link) == target:
                continue
            link.unlink()
        os.symlink(target, link)
    (repo / "refs" / "main").write_text(revision)
    return snapshot
