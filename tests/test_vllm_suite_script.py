"""Light tests of scripts/vllm_suite.py (issue 5): the pure parts, without vLLM.

The comparison itself (two pytest runs of vLLM's offloading connector suite) runs in a
vLLM environment through the script; here: junit parsing and the test-for-test
comparison on synthetic junit XML, the verdict rules, the sdist cache (through a
``file://`` index, no network), the import closure that picks the files to extract, and
the Hugging Face cache layout of shim 1.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import sys
import tarfile
from pathlib import Path

import pytest

from kvguard.guards.hooking import vllm_source

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


vs = _load("vllm_suite", ROOT / "scripts" / "vllm_suite.py")
hf = _load("vllm_suite_hf_cache", ROOT / "tests" / "vllm_suite_shims" / "vllm_suite_hf_cache.py")

MOD = "tests.v1.kv_connector.unit.offloading_connector"


def junit(*cases: str) -> str:
    body = "".join(cases)
    return (
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" '
        f'tests="{len(cases)}">{body}</testsuite></testsuites>'
    )


def case(name: str, inner: str = "", cls: str = f"{MOD}.test_scheduler") -> str:
    return f'<testcase classname="{cls}" name="{name}" time="0.5">{inner}</testcase>'


PASS = ""
FAIL = '<failure message="AssertionError: 129 &lt;= 128">trace</failure>'
ERROR = '<error message="failed on setup with &quot;OSError: no hub&quot;">trace</error>'
SKIP = '<skipped type="pytest.skip" message="needs CUDA">skip</skipped>'
XFAIL = '<skipped type="pytest.xfail" message="known bug">x</skipped>'


def results(**outcomes: str) -> dict:
    """{test_id: Result} from name=outcome keyword pairs."""
    inner = {"passed": PASS, "failed": FAIL, "error": ERROR, "skipped": SKIP}
    return vs.parse_junit(junit(*(case(n, inner[o]) for n, o in outcomes.items())))


# ----------------------------------------------------------------- junit parsing


class TestParseJunit:
    def test_outcome_and_reason_of_each_element(self):
        parsed = vs.parse_junit(
            junit(
                case("test_a[True]", PASS),
                case("test_b", FAIL),
                case("test_c", ERROR),
                case("test_d", SKIP),
                case("test_e", XFAIL),
            )
        )
        got = {tid.split("::")[1]: (r.outcome, r.reason) for tid, r in parsed.items()}
        assert got == {
            "test_a[True]": ("passed", ""),
            "test_b": ("failed", "AssertionError: 129 <= 128"),
            "test_c": ("error", 'failed on setup with "OSError: no hub"'),
            "test_d": ("skipped", "needs CUDA"),
            "test_e": ("skipped", "xfail: known bug"),
        }

    def test_id_is_classname_and_parametrised_name(self):
        parsed = vs.parse_junit(junit(case("test_x[8-True]", cls=f"{MOD}.test_worker.TestW")))
        assert list(parsed) == [f"{MOD}.test_worker.TestW::test_x[8-True]"]
        assert parsed[f"{MOD}.test_worker.TestW::test_x[8-True]"].seconds == 0.5

    def test_failure_wins_over_a_teardown_error(self):
        parsed = vs.parse_junit(junit(case("test_t", ERROR + FAIL)))
        assert [r.outcome for r in parsed.values()] == ["failed"]

    def test_duplicate_id_is_rejected(self):
        with pytest.raises(ValueError, match="twice"):
            vs.parse_junit(junit(case("test_a"), case("test_a")))

    def test_long_reason_is_cut_to_one_line(self):
        long = "x" * 500
        parsed = vs.parse_junit(junit(case("t", f'<failure message="{long}&#10;second">t</failure>')))
        (reason,) = [r.reason for r in parsed.values()]
        assert len(reason) == 240 and reason.endswith("...") and "second" not in reason


# ----------------------------------------------------------------- comparison


class TestComparison:
    def test_tally_counts_every_outcome(self):
        r = results(a="passed", b="passed", c="failed", d="error", e="skipped")
        assert vs.tally(r) == {"passed": 2, "failed": 1, "error": 1, "skipped": 1, "total": 5}

    def test_same_outcomes_give_no_difference(self):
        assert vs.differences(results(a="passed", b="skipped"), results(a="passed", b="skipped")) == []

    def test_each_changed_or_missing_id_is_listed_once_sorted(self):
        plain = results(a="passed", b="failed", c="passed")
        guarded = results(a="failed", b="failed", d="passed")
        ids = {name: f"{MOD}.test_scheduler::{name}" for name in "abcd"}
        assert vs.differences(plain, guarded) == [
            (ids["a"], "passed", "failed"),
            (ids["c"], "passed", "absent"),
            (ids["d"], "absent", "passed"),
        ]

    def test_table_has_one_row_per_run(self):
        text = vs.format_table(
            {"plain": vs.tally(results(a="passed", b="failed")), "guarded": vs.tally(results(a="passed"))},
            {"plain": 271.04, "guarded": 280.0},
            {"plain": 250.0, "guarded": 262.55},
        )
        lines = text.splitlines()
        assert lines[0].split() == ["run", "passed", "failed", "error", "skipped", "total", "wall", "s", "cpu", "s"]
        assert lines[2].split() == ["plain", "1", "1", "0", "0", "2", "271.0", "250.0"]
        assert lines[3].split() == ["guarded", "1", "0", "0", "0", "1", "280.0", "262.6"]


# ----------------------------------------------------------------- verdict


def report(evaluations: float = 0, installed: float = 0, snapshot_evaluated: int = 0, bucket: float = 0):
    metrics = [
        {"name": "kvguard_check_evaluations_total", "labels": {"check": "swa_pending_bound"}, "value": evaluations},
        {"name": "kvguard_site_installed", "labels": {"site": "scheduler.swa"}, "value": installed},
        {"name": "kvguard_swa_pending_bound_ratio_bucket", "labels": {"le": "1.0"}, "value": bucket},
    ]
    snapshot = {"swa_pending_bound": {"evaluated": snapshot_evaluated, "tolerated": 0, "violations": 0,
                                      "max_pending_blocks": None, "bound": None}}
    return {"metrics": metrics, "snapshot": snapshot, "errors": []}


ON, OFF = report(evaluations=12, installed=1, snapshot_evaluated=12), report()


class TestVerdict:
    def test_transparent_run_passes(self):
        r = results(a="passed", b="skipped")
        assert vs.verdict(r, dict(r), 1, OFF, ON) == []

    def test_one_difference_fails(self):
        problems = vs.verdict(results(a="passed"), results(a="failed"), 0, OFF, ON)
        assert problems == ["1 test ids differ between the plain and the guarded run"]

    def test_threshold_applies_to_each_run(self):
        r = results(a="passed", b="failed")
        assert vs.verdict(r, dict(r), 2, OFF, ON) == [
            "plain run: 1 passed < 2 required",
            "guarded run: 1 passed < 2 required",
        ]

    def test_guarded_run_without_kvguard_fails(self):
        r = results(a="passed")
        for guarded_report in (None, OFF):
            assert vs.verdict(r, dict(r), 1, OFF, guarded_report) == [
                "guarded run: kvguard did not install any site nor evaluate any check"
            ]

    def test_a_guard_error_in_the_guarded_run_fails(self):
        r = results(a="passed")
        erring = report(evaluations=12, installed=1, snapshot_evaluated=12)
        erring["metrics"].append({"name": "kvguard_guard_errors_total", "labels": {"stage": "admission"}, "value": 79})
        assert vs.verdict(r, dict(r), 1, OFF, erring) == [
            "guarded run: 79 kvguard guard errors (kvguard_guard_errors_total)"
        ]

    def test_kvguard_active_in_the_plain_run_fails(self):
        r = results(a="passed")
        assert vs.verdict(r, dict(r), 1, report(installed=1), ON) == [
            "plain run: kvguard was active although KVGUARD_DISABLE=1"
        ]

    def test_counter_rows_keep_zero_values_and_drop_buckets(self):
        assert vs.counter_rows(report(bucket=3)) == [
            ("kvguard_check_evaluations_total", "check=swa_pending_bound", 0.0),
            ("kvguard_site_installed", "site=scheduler.swa", 0.0),
        ]
        assert vs.kvguard_activity(ON) == {
            "sites_installed": 1.0, "evaluations": 12.0, "snapshot_evaluated": 12.0,
            "violations": 0.0, "guard_errors": 0.0,
        }


class TestRender:
    def test_report_lists_differences_reasons_and_zero_counters(self, tmp_path):
        plain = vs.Run("plain", {"KVGUARD_DISABLE": "1"}, tmp_path / "p", 10.0, 9.0, 1)
        guarded = vs.Run("guarded", {"KVGUARD_POLICY": "guard"}, tmp_path / "g", 11.0, 9.5, 1)
        text = vs.render(plain, guarded, results(a="passed", b="skipped"), results(a="failed", b="skipped"),
                         OFF, ON)
        assert "differing test ids: 1" in text
        assert f"  {MOD}.test_scheduler::a: plain=passed guarded=failed" in text
        assert "plain run, not passed: 1" in text and "           reason: needs CUDA" in text
        assert "    kvguard_site_installed{site=scheduler.swa} 1" in text
        assert "    kvguard_swa_pending_bound_ratio_bucket" not in text
        assert "    swa_pending_bound: bound=None, evaluated=12, max_pending_blocks=None" in text
        assert text.rstrip().endswith("sites_installed=0, evaluations=0, snapshot_evaluated=0, "
                                      "violations=0, guard_errors=0")


# ----------------------------------------------------------------- run environment


class TestRunEnvironment:
    def test_runs_differ_only_in_kvguard_settings_and_paths(self, tmp_path):
        base = {"PATH": "/bin", "KVGUARD_POLICY": "strict", "HF_TOKEN": "t", "PYTHONPATH": "/work/main"}
        plain = vs.Run("plain", {"KVGUARD_DISABLE": "1"}, tmp_path / "plain")
        guarded = vs.Run("guarded", {"KVGUARD_POLICY": "guard"}, tmp_path / "guarded")
        hf_home = tmp_path / "hf"
        e1, e2 = vs.run_env(base, plain, hf_home), vs.run_env(base, guarded, hf_home)
        changed = {k for k in e1.keys() | e2.keys() if e1.get(k) != e2.get(k)}
        assert changed == {"KVGUARD_DISABLE", "KVGUARD_POLICY", "KVGUARD_STATE_DIR", "KVSUITE_REPORT"}
        assert e1["KVGUARD_DISABLE"] == "1" and "KVGUARD_POLICY" not in e1
        assert e2["KVGUARD_POLICY"] == "guard" and "KVGUARD_DISABLE" not in e2
        assert "HF_TOKEN" not in e1 and e1["HF_HUB_OFFLINE"] == "1" and e1["HF_HOME"] == str(hf_home)
        assert e1["PYTHONPATH"] == str(vs.SHIMS)

    def test_pytest_command_is_the_same_but_for_the_junit_path(self, tmp_path):
        plain = vs.Run("plain", {}, tmp_path / "plain")
        guarded = vs.Run("guarded", {}, tmp_path / "guarded")
        c1 = vs.pytest_command(Path("py"), plain, ["-x"])
        c2 = vs.pytest_command(Path("py"), guarded, ["-x"])
        assert [a for a in c1 if not a.startswith("--junitxml")] == [a for a in c2 if not a.startswith("--junitxml")]
        assert c1[:4] == ["py", "-m", "pytest", vs.SUITE]
        for plugin in ("vllm_suite_hybrid_kv", "vllm_suite_session", "no:cacheprovider"):
            assert c1[c1.index(plugin) - 1] == "-p"
        assert c1[-1] == "-x" and f"--junitxml={plain.junit}" in c1


# ----------------------------------------------------------------- sdist cache


def make_sdist(path: Path, files: dict[str, bytes], version: str = "9.9.9") -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"vllm-{version}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


class TestSimpleIndexPage:
    SHA = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"

    def test_pep691_json(self):
        body = json.dumps({"files": [
            {"filename": "vllm-0.33.0-cp38-abi3-manylinux1_x86_64.whl", "url": "w", "hashes": {"sha256": "0"}},
            {"filename": "vllm-0.33.0.tar.gz", "url": "https://files/vllm-0.33.0.tar.gz",
             "hashes": {"sha256": self.SHA}},
        ]}).encode()
        got = vs.find_in_simple_page(body, "application/vnd.pypi.simple.v1+json", "vllm-0.33.0.tar.gz")
        assert got == ("https://files/vllm-0.33.0.tar.gz", self.SHA)

    def test_pep503_html_with_relative_link(self):
        body = (f'<html><body><a href="../../p/vllm-0.25.1.tar.gz#sha256=0">vllm-0.25.1.tar.gz</a>'
                f'<a href="../../p/vllm-0.33.0.tar.gz#sha256={self.SHA}">vllm-0.33.0.tar.gz</a>'
                "</body></html>").encode()
        got = vs.find_in_simple_page(body, "text/html", "vllm-0.33.0.tar.gz")
        assert got == ("../../p/vllm-0.33.0.tar.gz", self.SHA)

    def test_missing_file_or_hash_is_a_setup_error(self):
        with pytest.raises(vs.SetupError, match="lists no vllm-9.tar.gz"):
            vs.find_in_simple_page(b'{"files": []}', "application/vnd.pypi.simple.v1+json", "vllm-9.tar.gz")
        with pytest.raises(vs.SetupError, match="no sha256"):
            vs.find_in_simple_page(b'<a href="x.tar.gz">vllm-9.tar.gz</a>', "text/html", "vllm-9.tar.gz")


class TestFetchSdist:
    def test_download_is_verified_cached_and_reused_offline(self, tmp_path, monkeypatch):
        source = make_sdist(tmp_path / "upstream.tar.gz", {"pyproject.toml": b"[x]\n"})
        digest = hashlib.sha256(source.read_bytes()).hexdigest()
        calls = []

        def entry(index_url, filename):
            calls.append((index_url, filename))
            return source.as_uri(), digest

        monkeypatch.setattr(vllm_source, "index_file_entry", entry)
        cache = tmp_path / "cache"
        got = vs.fetch_sdist("9.9.9", cache, "https://index.invalid/simple")
        assert got == cache / "vllm-9.9.9.tar.gz" and got.read_bytes() == source.read_bytes()
        assert (cache / "vllm-9.9.9.tar.gz.sha256").read_text().strip() == digest
        assert calls == [("https://index.invalid/simple", "vllm-9.9.9.tar.gz")]
        assert vs.fetch_sdist("9.9.9", cache, "https://index.invalid/simple") == got
        assert len(calls) == 1  # the cached, verified file needs no index

    def test_digest_mismatch_is_an_error_and_leaves_no_file(self, tmp_path, monkeypatch):
        source = make_sdist(tmp_path / "upstream.tar.gz", {"pyproject.toml": b""})
        monkeypatch.setattr(vllm_source, "index_file_entry", lambda i, f: (source.as_uri(), "0" * 64))
        with pytest.raises(vs.SetupError, match="sha256"):
            vs.fetch_sdist("9.9.9", tmp_path / "cache", "x")
        assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == []


# ----------------------------------------------------------------- extraction


SUITE_FILES = {
    "pyproject.toml": b"[tool.pytest.ini_options]\n",
    "tests/__init__.py": b"",
    "tests/conftest.py": b"from tests.models.utils import check\n",
    "tests/models/__init__.py": b"",
    "tests/models/utils.py": b"import os\n",
    "tests/models/unrelated.py": b"",
    "tests/utils.py": b"",
    "tests/v1/__init__.py": b"",
    "tests/v1/kv_connector/__init__.py": b"",
    "tests/v1/kv_connector/unit/__init__.py": b"",
    "tests/v1/kv_connector/unit/conftest.py": b"",
    "tests/v1/kv_connector/unit/utils.py": b"def f():\n    from tests.utils import g\n",
    "tests/v1/kv_connector/unit/test_nixl.py": b"",
    f"{vs.SUITE}/__init__.py": b"",
    f"{vs.SUITE}/utils.py": b"from ..utils import create_vllm_config\n",
    f"{vs.SUITE}/test_scheduler.py": b"from .utils import x\nimport numpy\n",
}


class TestExtract:
    def test_relative_and_nested_imports_are_resolved(self):
        got = vs.imported_test_modules(b"from ..utils import a\n", f"{MOD}.utils", is_package=False)
        assert got == {"tests.v1.kv_connector.unit.utils", "tests.v1.kv_connector.unit.utils.a"}
        got = vs.imported_test_modules(b"def f():\n    import tests.utils\n", "tests.x", False)
        assert got == {"tests.utils"}

    def test_closure_takes_the_suite_its_conftests_and_imports_only(self):
        assert vs.suite_closure(SUITE_FILES) == sorted(
            set(SUITE_FILES) - {"tests/models/unrelated.py", "tests/v1/kv_connector/unit/test_nixl.py"}
        )

    def test_missing_suite_is_a_setup_error(self):
        files = {k: v for k, v in SUITE_FILES.items() if not k.startswith(vs.SUITE)}
        with pytest.raises(vs.SetupError, match="no test files"):
            vs.suite_closure(files)

    def test_a_suite_of_test_files_takes_those_present_and_their_folders_conftests(self):
        """``--suite simple``: single test files, one of which the release lacks."""
        files = {**SUITE_FILES,
                 "tests/v1/simple_kv_offload/__init__.py": b"",
                 "tests/v1/simple_kv_offload/conftest.py": b"",
                 "tests/v1/simple_kv_offload/test_scheduler.py": b"from tests.v1.kv_connector.unit.utils import f\n",
                 "tests/v1/simple_kv_offload/test_worker.py": b""}
        simple = vs.SUITES["simple"]
        assert vs.present_suite(files, simple) == ("tests/v1/simple_kv_offload/test_scheduler.py",)
        chosen = vs.suite_closure(files, simple)
        assert "tests/v1/simple_kv_offload/test_scheduler.py" in chosen
        assert "tests/v1/simple_kv_offload/conftest.py" in chosen
        assert "tests/v1/kv_connector/unit/utils.py" in chosen and "tests/utils.py" in chosen  # its imports
        assert "tests/v1/simple_kv_offload/test_worker.py" not in chosen
        assert not [c for c in chosen if c.startswith(vs.SUITE + "/")]
        with pytest.raises(vs.SetupError, match="no test files"):
            vs.suite_closure(SUITE_FILES, simple)

    def test_extract_writes_bytes_unchanged_into_a_fresh_folder(self, tmp_path):
        sdist = make_sdist(tmp_path / "s.tar.gz", SUITE_FILES)
        dest = tmp_path / "src"
        (dest / "stale").mkdir(parents=True)
        chosen = vs.extract_suite(sdist, dest)
        written = {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()}
        assert written == set(chosen) | {"EXTRACTED.json"}
        assert all((dest / rel).read_bytes() == SUITE_FILES[rel] for rel in chosen)
        manifest = json.loads((dest / "EXTRACTED.json").read_text())
        assert manifest[f"{vs.SUITE}/test_scheduler.py"] == hashlib.sha256(
            SUITE_FILES[f"{vs.SUITE}/test_scheduler.py"]).hexdigest()


# ----------------------------------------------------------------- shim 1: HF cache


class TestHfCache:
    def test_layout_matches_huggingface_hub(self, tmp_path):
        snapshot = hf.write_hf_cache_entry(tmp_path)
        repo = tmp_path / "hub" / "models--facebook--opt-125m"
        revision = (repo / "refs" / "main").read_text()
        assert snapshot == repo / "snapshots" / revision and len(revision) == 40
        for name, content in hf.OPT_125M_FILES.items():
            link = snapshot / name
            assert link.is_symlink() and not os.path.isabs(os.readlink(link))
            data = link.read_bytes()
            assert json.loads(data) == content
            assert Path(os.path.realpath(link)) == (repo / "blobs" / hashlib.sha256(data).hexdigest()).resolve()

    def test_published_opt_125m_architecture(self):
        c = hf.OPT_125M_CONFIG
        assert (c["model_type"], c["architectures"]) == ("opt", ["OPTForCausalLM"])
        assert (c["num_hidden_layers"], c["num_attention_heads"], c["hidden_size"], c["ffn_dim"]) == (12, 12, 768, 3072)
        assert (c["vocab_size"], c["max_position_embeddings"], c["torch_dtype"]) == (50272, 2048, "float16")

    def test_rewrite_is_idempotent(self, tmp_path):
        first = hf.write_hf_cache_entry(tmp_path)
        before = sorted((p.relative_to(tmp_path).as_posix(), p.is_symlink()) for p in tmp_path.rglob("*"))
        assert hf.write_hf_cache_entry(tmp_path) == first
        after = sorted((p.relative_to(tmp_path).as_posix(), p.is_symlink()) for p in tmp_path.rglob("*"))
        assert before == after

    def test_revision_depends_on_the_bytes(self):
        a = hf.local_revision({"config.json": b"{}"})
        assert a == hf.local_revision({"config.json": b"{}"})
        assert a != hf.local_revision({"config.json": b"{ }"})
