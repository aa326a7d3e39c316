"""Provenance that cannot drift (issue 24, item 6), without launching a real script:

* every committed results file (the set of :func:`experiments.reports.provenance.results_files`)
  carries its command, commit, machine, cores, date and the load before and after its run, and
  a table whose load reached the core count says so (:data:`KNOWN_STALE` lists the files
  committed before the check; it only shrinks);
* what ``write_table`` / ``write_part`` / ``write_raw`` write passes the check, with the flag
  exactly when a load was at or above the core count;
* a script that did nothing (exit ``EXIT_SKIP``) is ``skip (<reason>)`` in ``regenerate.py``'s
  manifest and README block, never ``ok``;
* the READMEs quote the records: the generated block of ``experiments/README.md`` is what
  ``regenerate.py --readme-only`` builds from the stored ``headline.json`` files, and the top
  README's transformer numbers are those of the runs' ``summary.json``.
"""
from __future__ import annotations

import json
import os
import re
import statistics
import sys
from pathlib import Path

import pytest

from experiments import regenerate as rg
from experiments.reports import provenance as prov
from mgrit.reporting import writers as report

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "experiments" / "results"

_TWO_COMMITS = "issue 16's before/after table of two commits, not a record run"
#: Committed results files that lack provenance (written before ``cores`` and ``loadavg_after``
#: existed, or by a script with its own header). The list only shrinks: a listed file that
#: passes, or no longer exists, fails the test until it is removed from here.
KNOWN_STALE = {
    "records/layerwise_loop/comparison.json": _TWO_COMMITS,
    "records/layerwise_loop/summary.md": _TWO_COMMITS,
}


def test_committed_results_carry_provenance():
    files = {f.relative_to(RESULTS).as_posix(): f for f in prov.results_files(RESULTS)}
    assert "reproductions/kirby2020/table.md" in files  # the walk reaches the rooms
    bad = {k: prov.problems(f) for k, f in files.items()}
    new = {k: p for k, p in bad.items() if p and k not in KNOWN_STALE}
    assert not new, f"results files without provenance: {new}"
    fixed = sorted(k for k in KNOWN_STALE if k in files and not bad[k])
    gone = sorted(k for k in KNOWN_STALE if k not in files)
    assert not fixed and not gone, f"remove from KNOWN_STALE: {fixed + gone}"


@pytest.fixture
def load(monkeypatch):
    """Set the load averages that ``report`` reads: ``load(1.0)`` -> (1.0, 1.0, 1.0)."""
    def set_load(x):
        monkeypatch.setattr(report.os, "getloadavg", lambda: (x, x, x))
    return set_load


@pytest.mark.parametrize("before, after", [(0.25, 0.5), (None, 0.0), (0.0, None)])
def test_write_table_records_provenance_and_flags_load(tmp_path, load, before, after):
    """None: the core count itself (at the limit counts as loaded)."""
    cores = os.cpu_count()
    load(cores if before is None else before)
    meta = report.run_metadata(["bench.py", "--n", "3"])
    load(cores if after is None else after)
    f = tmp_path / "t.md"
    report.write_table(f, "T", meta, "| a |\n|---|\n| 1 |")
    text = f.read_text()
    (run,) = prov.table_runs(text)
    want_after = f"{cores if after is None else after:.2f}"
    assert run["loadavg"].split() == [f"{cores if before is None else before:.2f}"] * 3
    assert run["loadavg_after"].split() == [want_after] * 3
    assert run["command"] == "bench.py --n 3" and int(run["cores"]) == cores
    assert run["commit"] == meta["commit"] and run["date"] == meta["date"]
    flagged = before is None or after is None
    assert (report.LOAD_FLAG in text) == flagged
    assert prov.problems(f) == []
    if flagged:  # the same table without its flag fails
        f.write_text("\n".join(ln for ln in text.splitlines() if report.LOAD_FLAG not in ln))
        assert "no line" in " ".join(prov.problems(f))
    f.write_text(text.replace(f"- loadavg_after: {run['loadavg_after']}\n", ""))
    assert prov.problems(f) == ["run 0: no loadavg_after"]


def test_parts_store_and_part_lines_carry_provenance(tmp_path, load):
    from experiments.reports.study_parts import read_part, write_part
    cores = os.cpu_count()
    load(0.5)
    quiet = report.run_metadata()
    load(float(cores))
    write_part(tmp_path / "results.h5", "accuracy", {"a": [1.0]}, quiet)
    assert prov.problems(tmp_path / "results.h5") == []
    _, m = read_part(tmp_path / "results.h5", "accuracy")
    assert m["loadavg"] == "0.50 0.50 0.50" and m["loadavg_after"].split()[0] == f"{cores:.2f}"
    busy = dict(m, loadavg="0.10 0.10 0.10", loadavg_after="0.10 0.10 0.10")
    lines = report.part_lines("accuracy", m) + report.part_lines("timing", busy)
    assert [report.LOAD_FLAG in ln for ln in lines] == [False, True, False]
    text = "# T\n\n" + "\n".join(lines) + "\n\nbody\n"
    (tmp_path / "table.md").write_text(text)
    runs = prov.table_runs(text)
    assert [r["loadavg_after"] for r in runs] == [m["loadavg_after"], "0.10 0.10 0.10"]
    assert prov.problems(tmp_path / "table.md") == []
    (tmp_path / "table.md").write_text(text.replace(f"cores `{cores}`, ", "", 1))
    assert prov.problems(tmp_path / "table.md") == ["run 0: no cores"]


def test_part_stored_without_the_load_after_never_reads_todays(tmp_path):
    """A part written before ``cores``/``loadavg_after`` existed: a report rebuilt from it
    says they were not recorded (and the check fails it), never the load of today."""
    import h5py
    from experiments.reports.study_parts import read_part
    old = {k: "x" for k in ("command", "commit", "machine", "date")} | {"loadavg": "0.1 0.1 0.1"}
    with h5py.File(tmp_path / "results.h5", "w") as f:
        f.create_dataset("accuracy/a", data=[1.0])
        f.attrs["meta/accuracy"] = json.dumps(old)
    _, meta = read_part(tmp_path / "results.h5", "accuracy")
    assert meta == old | {"cores": "unknown (not recorded)",
                          "loadavg_after": "unknown (not recorded)"}
    assert prov.problems(tmp_path / "results.h5") == ["run 0: no cores, loadavg_after"]
    (tmp_path / "table.md").write_text("# T\n\n" + "\n".join(report.part_lines("a", meta)))
    assert prov.problems(tmp_path / "table.md") == ["run 0: no cores, loadavg_after"]


def test_write_raw_keeps_every_repeat_with_its_spread(tmp_path):
    vals = [0.30, 0.10, 0.20, 1.00, 0.25]
    out = report.write_raw(tmp_path / "t.raw.json", {"serial": vals}, report.run_metadata(), "s")
    doc = json.loads((tmp_path / "t.raw.json").read_text())
    s = doc["series"]["serial"]
    assert doc["unit"] == "s" and s == out["serial"] and s["values"] == vals
    q1, med, q3 = statistics.quantiles(vals, n=4, method="inclusive")
    assert s["median"] == pytest.approx(statistics.median(vals), abs=1e-15)
    assert (s["q1"], s["q3"], s["iqr"]) == pytest.approx((q1, q3, q3 - q1), abs=1e-15)
    assert (s["min"], s["max"], s["n"]) == (0.10, 1.00, 5)
    assert prov.problems(tmp_path / "t.raw.json") == []
    with pytest.raises(ValueError, match="at least one repeat"):
        report.spread([])


FAKE = {"fake_ok": "print('done')",
        "fake_skip": ("print('SKIP: no widget on this machine'); "
                      f"raise SystemExit({report.EXIT_SKIP})"),
        "fake_fail": "raise SystemExit(3)"}


def _fake_registry(tmp_path) -> tuple:
    """A registry of the :data:`FAKE` scripts, written under ``tmp_path/benchmarks``."""
    room = tmp_path / "benchmarks"
    room.mkdir()
    registry = []
    for name, code in FAKE.items():
        (room / f"{name}.py").write_text(code + "\n")
        registry.append(rg.Entry(name, str(room / f"{name}.py"), None, (), (), "timing", "test"))
    return tuple(registry)


def test_regenerate_lists_a_script_that_did_nothing_as_skip(tmp_path):
    registry = _fake_registry(tmp_path)
    out = tmp_path / "out"
    meta = report.run_metadata()
    records = rg.run_all("full", "all", out, None, 1, registry=registry)
    rg.write_manifest(out, records, "full", "all", meta)
    manifest = json.loads((out / "manifest.json").read_text())
    recs = {r["name"]: r["status"] for r in manifest["records"]}
    assert recs == {"fake_ok": "ok", "fake_skip": "skip (no widget on this machine)",
                    "fake_fail": "failed (3)"}
    assert "| fake_skip | timing | test | skip (no widget on this machine) |" in \
        (out / "MANIFEST.md").read_text()
    assert prov.problems(out / "MANIFEST.md") == [] and prov.problems(out / "manifest.json") == []
    assert rg.skipped_line(out) == ("Did nothing in the last run (`skip`, no result from this "
                                    "machine): `fake_skip` (no widget on this machine).")
    assert rg.readme_block(out).endswith(rg.skipped_line(out))
    assert rg.status(rg.reporting.EXIT_SKIP, "") == "skip (no reason printed)"


def test_a_record_run_resumes_at_one_commit_and_keeps_every_row(tmp_path):
    """``--resume``'s bookkeeping: rows carry their commit; a second sitting launches only the
    scripts without an ok/skip row at the same commit, and the merged manifest keeps one row
    per script with the sum of the durations as the run time."""
    registry = _fake_registry(tmp_path)
    out = tmp_path / "out"
    first = rg.run_all("full", "all", out, ["fake_ok", "fake_fail"], 1, registry=registry)
    first = [dict(r, part="all") for r in first]
    rg.write_manifest(out, first, "full", "all")
    commit = first[0]["commit"]
    assert commit and all(r["commit"] == commit for r in first)
    done = rg.resumable(out, commit, "all")
    assert done == {"fake_ok"}  # the failed one is run again
    assert rg.resumable(out, "0000000", "all") == frozenset()  # another commit: all again
    assert rg.resumable(out, commit, "timing") == {"fake_ok"}  # a part of an all-parts run
    second = rg.run_all("full", "all", out, None, 1, registry=registry, done=done)
    assert sorted(r["name"] for r in second) == ["fake_fail", "fake_skip"]
    rows = rg.merged(json.loads((out / "manifest.json").read_text())["records"],
                     [dict(r, part="all") for r in second], registry)
    assert [r["name"] for r in rows] == ["fake_ok", "fake_skip", "fake_fail"]
    assert rows[0] == first[0]  # kept from the first sitting
    rg.write_manifest(out, rows, "full", "all")
    meta = json.loads((out / "manifest.json").read_text())["meta"]
    assert meta["commit"] == commit and meta["part"] == "all"
    assert meta["total_seconds"] == round(sum(r["seconds"] for r in rows), 1)
    assert rg.manifest_commit([{"commit": "a"}, {"commit": "b"}, {}], "x") == "mixed (a, b)"
    assert rg.manifest_commit([{}], "x") == "x"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is present")
def test_gpu_benchmark_without_a_gpu_skips(tmp_path, capsys):
    sys.path.insert(0, str(ROOT))
    from experiments.benchmarks import bench_gpu
    assert bench_gpu.main(["--out", str(tmp_path)]) == report.EXIT_SKIP
    assert capsys.readouterr().out.startswith("SKIP: no CUDA device")
    assert not (tmp_path / "bench_gpu.md").exists()


def test_readme_block_is_built_from_the_stored_records():
    text = rg.README.read_text()
    block = text.split(rg.BEGIN, 1)[1].split(rg.END, 1)[0].strip()
    assert block == rg.readme_block(RESULTS).strip()
    top = rg.TOP_README.read_text()
    block = top.split(rg.TOP_BEGIN, 1)[1].split(rg.TOP_END, 1)[0].strip()
    assert block == rg.readme_block(RESULTS, rg.TOP_STUDIES, "experiments/").strip()
    assert set(rg.TOP_STUDIES) <= {e.name for e in rg.REGISTRY}


def test_top_readme_quotes_the_transformer_records():
    """The top README's transformer sentence is recomputed from the stored runs: in the record's
    form over seeds (``choice.json`` beside the runs) ``transformer_records.readme_sentence``
    of its analysis; until that record is regenerated, the one-seed runs' final numbers."""
    base = RESULTS / "records" / "transformers"
    runs = base / "runs"
    readme = re.sub(r"\s+", " ", (ROOT / "README.md").read_text())
    if (base / "choice.json").is_file():  # the record over seeds (issue 24 item 2)
        from experiments.records import transformer_records as tr
        a = tr.analyse(base, tr.SEEDS, tuple(tr.VARIANTS), tuple(tr.CANDIDATES))
        assert a, "the stored transformer record has no analysable runs"
        assert tr.readme_sentence(a) in readme
        return

    def final(run):
        return json.loads((runs / run / "summary.json").read_text())["final"]

    def gpt(run):
        return 100 * (final(run)["test_loss"] / final("gpt-serial")["test_loss"] - 1)

    def vit(run):
        return 100 * (final(run)["test_acc"] - final("vit-serial")["test_acc"])

    lo, hi = vit("vit-mgrit-2cycles"), vit("vit-mgrit")
    assert lo < 0 < hi  # the sentence's "below" / "above"
    want = (f"with 2 / 1 the GPT's validation loss ended {gpt('gpt-mgrit-2cycles'):.1f}% above "
            f"serial and the ViT {-lo:.1f} points below; with 3 / 2, +{gpt('gpt-mgrit'):.1f}% "
            f"and {hi:.1f} points above")
    assert want in readme


def test_readme_names_the_commit_of_the_manifest():
    """The README's statement of the committed tables names the commit of the stored
    ``manifest.json`` (the last ``regenerate.py --full``), and every row names the commit it ran at."""
    commit = json.loads((RESULTS / "manifest.json").read_text())["meta"]["commit"]
    text = re.sub(r"\s+", " ", rg.README.read_text())
    stated = re.search(r"`python experiments/regenerate.py --full` at commit `([^`]+)`", text)
    assert stated is not None and stated.group(1) == commit
    # every row of the manifest names the commit it ran at (rows of the run before rows did:
    # the manifest's commit of that run)
    rows = json.loads((RESULTS / "manifest.json").read_text())["records"]
    assert all(r.get("commit") and r["commit"] in commit for r in rows)


def test_interval_matches_the_student_t_formula_and_refuses_bad_input():
    import math
    from mgrit.reporting.writers import interval, paired_interval
    # n = 3: t_{0.975, 2} = 4.30265 (printed tables, 6 digits); mean 2, sd 1
    r = interval([1.0, 2.0, 3.0])
    assert r["n"] == 3 and r["mean"] == 2.0 and abs(r["sd"] - 1.0) < 1e-15
    half = 4.302653 / math.sqrt(3)
    assert abs(r["lo"] - (2 - half)) < 1e-6 and abs(r["hi"] - (2 + half)) < 1e-6
    one = interval([0.5])
    assert one["mean"] == 0.5 and math.isnan(one["lo"]) and math.isnan(one["hi"])
    d = paired_interval([0.9, 0.8, 0.7], [0.91, 0.82, 0.73])
    assert abs(d["mean"] - 0.02) < 1e-12 and d["lo"] < 0.02 < d["hi"]
    with pytest.raises(ValueError, match="no values"):
        interval([])
    with pytest.raises(ValueError, match="level"):
        interval([1.0, 2.0], level=1.5)
    with pytest.raises(ValueError, match="pairs"):
        paired_interval([1.0], [1.0, 2.0])


def _git(*args: str) -> str:
    import subprocess
    p = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                       timeout=60)
    if p.returncode:
        raise LookupError(p.stderr.strip())
    return p.stdout


def _pytest_section_only(old: str, new: str) -> bool:
    """Whether two versions of ``setup.cfg`` differ only in ``[tool:pytest]``."""
    import configparser
    cfg = []
    for text in (old, new):
        c = configparser.ConfigParser(interpolation=None)
        c.read_string(text)
        cfg.append({s: dict(c[s]) for s in c.sections() if s != "tool:pytest"})
    return cfg[0] == cfg[1]


def mixed_record_problems(rows: list) -> list:
    """What breaks a record whose ``rows`` (manifest rows: ``name``, ``commit``) ran at more
    than one commit: it holds only when every older row's script ran the code of the newest
    commit, i.e. between each older commit and the newest the only files that changed are the
    scripts of the rows rerun at the newest commit (none of them the script of an older row),
    tests, ``.md`` files, the results, and ``setup.cfg``'s ``[tool:pytest]`` section. Raises
    LookupError when a commit is not in this clone's history."""
    commits = sorted({r["commit"] for r in rows})
    if len(commits) < 2:
        return []
    full = {c: _git("rev-parse", "--verify", f"{c}^{{commit}}").strip() for c in commits}

    def descends(a, b):  # b is a descendant of a (or a itself)
        try:
            _git("merge-base", "--is-ancestor", full[a], full[b])
            return True
        except LookupError:
            return False
    newest = [c for c in commits if all(descends(o, c) for o in commits)]
    if len(newest) != 1:
        return [f"no commit of {commits} descends from all the others"]
    newest = newest[0]
    scripts = {e.name: e.script for e in rg.REGISTRY}
    rerun = {scripts[r["name"]] for r in rows if r["commit"] == newest}
    older = {scripts[r["name"]] for r in rows if r["commit"] != newest}
    out = [f"script with rows at two commits: {f}" for f in sorted(rerun & older)]
    for c in commits:
        if c == newest:
            continue
        for f in _git("diff", "--name-only", full[c], full[newest]).split():
            if f in rerun or f.startswith(("tests/", "experiments/results/")) or \
                    f.endswith(".md"):
                continue
            if f == "setup.cfg" and _pytest_section_only(
                    _git("show", f"{full[c]}:setup.cfg"),
                    _git("show", f"{full[newest]}:setup.cfg")):
                continue
            out.append(f"{f} changed between {c} and {newest}")
    return out


def test_a_record_of_two_commits_differs_only_in_the_rerun_scripts():
    """The stored manifest: one commit (every row at the manifest's commit), or several that
    :func:`mixed_record_problems` accepts."""
    data = json.loads((RESULTS / "manifest.json").read_text())
    rows = data["records"]
    commits = sorted({r["commit"] for r in rows})
    if len(commits) == 1:
        assert data["meta"]["commit"] == commits[0]
        return
    try:
        assert mixed_record_problems(rows) == []
    except LookupError as e:  # a clone without the history (e.g. shallow)
        pytest.skip(f"the record's commits are not in this clone's history: {e}")


def test_mixed_record_problems_names_code_that_changed():
    """Against this repository's history: 48a9d82 -> f3b2e6d changed results, READMEs, tests
    and setup.cfg's pytest options only (accepted); d8564ac -> 48a9d82 changed library code
    (refused, naming a file); a script at two commits is refused."""
    try:
        _git("rev-parse", "--verify", "d8564ac^{commit}")
        _git("rev-parse", "--verify", "f3b2e6d^{commit}")
    except LookupError as e:
        pytest.skip(f"history not in this clone: {e}")
    ok = [{"name": "plan", "commit": "48a9d82"}, {"name": "transformers", "commit": "f3b2e6d"}]
    assert mixed_record_problems(ok) == []
    changed = _git("diff", "--name-only", "d8564ac", "48a9d82").split()
    assert any(f.startswith("mgrit/") for f in changed)
    bad = mixed_record_problems([{"name": "plan", "commit": "d8564ac"},
                                 {"name": "transformers", "commit": "48a9d82"}])
    assert any(p.startswith("mgrit/") and "between d8564ac and 48a9d82" in p for p in bad), bad
    both = mixed_record_problems([{"name": "batchnorm_dropout", "commit": "48a9d82"},
                                  {"name": "tied_resnet", "commit": "f3b2e6d"}])
    assert "script with rows at two commits: experiments/records/stateful_records.py" in both
