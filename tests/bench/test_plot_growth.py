"""bench/plot_growth.py draws the growth picture and its table from bench/growth.py's JSON."""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _plot_growth():
    spec = importlib.util.spec_from_file_location("plot_growth", REPO / "bench" / "plot_growth.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _point(**kw):
    base = {"steps": 900, "requests_per_step": 7.5, "store_checks_per_step": 0.2, "vllm_step_us": 480.0,
            "kvguard_added_us_per_step": 9.25, "min_sum_ratio": 1.0193, "median_step_ratio": 1.011, "sum_ratio": 1.02}
    base.update(kw)
    return base


DATA = {
    "vllm_version": "0.33.0", "reps": 2, "date": "2026-12-04 08:00 UTC",
    "running": [_point(agents=8), _point(agents=64, requests_per_step=41.0, vllm_step_us=2900.0,
                                         kvguard_added_us_per_step=31.5)],
    "chunks": [_point(prompt_tokens=2048, chunks_per_hit=8), _point(prompt_tokens=32768, chunks_per_hit=128)],
    "aa": _point(agents=16, kvguard_added_us_per_step=-0.4, min_sum_ratio=0.9992),
}


def test_the_picture_and_the_table_are_drawn_from_the_sweep(tmp_path):
    src = tmp_path / "growth.json"
    src.write_text(json.dumps(DATA))
    png, md = tmp_path / "img" / "growth.png", tmp_path / "growth.md"
    assert _plot_growth().main([str(src), "--png", str(png), "--table", str(md)]) == 0
    head = png.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", head[16:24])
    assert (width, height) == (1000, 400)  # figsize 10 x 4 inches at 100 dpi
    text = md.read_text()
    assert "| 64 | 41.0 | 0.2 | 900 | 2900.0 | +31.50 | 1.0193 | 1.0110 |" in text
    assert "| 32768 | 128 |" in text
    assert "-0.40 us per step (sum of minima on/off 0.9992)" in text
    assert "](img/bench-growth.png)" in text


def test_a_json_without_a_sweep_is_refused_by_name(tmp_path):
    src = tmp_path / "growth.json"
    src.write_text(json.dumps({**DATA, "chunks": []}))
    with pytest.raises(SystemExit, match="no 'chunks' sweep"):
        _plot_growth().main([str(src), "--png", str(tmp_path / "g.png"), "--table", str(tmp_path / "g.md")])
