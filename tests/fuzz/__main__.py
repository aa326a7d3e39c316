"""Command line of the differential fuzzer (see the package docstring).

    python -m tests.fuzz campaign --programs 2000 --ranks 1,2,3 [--enable all] [--hours 1]
    python -m tests.fuzz replay --ranks 2 '<program json>'
    python -m tests.fuzz paths --programs 60 --ranks 1,2,3   # tests.fuzz.paths_distributed

``campaign`` runs seeds ``start, start+1, ...`` in chunks, one ``mpiexec`` per chunk and rank
count (the same seeds on every rank count), until ``--programs`` programs ran or ``--hours``
passed; it appends every finding (seed, rank count, verdict, shrunk program) to
``OUT/findings.jsonl`` as it goes, prints one line per chunk and writes ``OUT/summary.json``
(programs, seconds and programs per hour per rank count, verdict counts, findings). A job that
hangs is ended by ``--timeout`` and recorded with the program it was running (not shrunk).
Run it in the background: ``nohup python -m tests.fuzz campaign ... > campaign.log &``.
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
import time
from pathlib import Path

from tests.mpi_harness import _launch

from .program import FEATURES, KNOWN_BROKEN_ON_MAIN, default_features


def _features(text: str) -> list:
    """The default features plus those named (``all``: every one)."""
    if text in ("", "default"):
        return sorted(default_features())
    names = sorted(FEATURES) if text == "all" else text.split(",")
    bad = [n for n in names if n not in FEATURES]
    if bad:
        raise SystemExit(f"--enable {text!r}: unknown feature(s) {bad}; use 'all', 'default' or "
                         f"a comma list of {sorted(FEATURES)}")
    return sorted(default_features() | set(names))


def _ranks(text: str) -> list:
    try:
        ranks = [int(r) for r in text.split(",")]
    except ValueError:
        ranks = []
    if not ranks or any(not 1 <= r <= 8 for r in ranks):
        raise SystemExit(f"--ranks {text!r} is not allowed: use a comma list of ints in 1..8")
    return ranks


def _chunk(ranks, seeds, enabled, out: Path, timeout, budget):
    """One mpiexec over ``seeds``; returns ``(summary or None, the last seed it ran or None)``;
    a job that failed is recorded as a finding with the program it was running."""
    findings, progress = out / "findings.jsonl", out / f"progress-{ranks}.json"
    progress.unlink(missing_ok=True)
    kwargs = {"seeds": seeds, "enabled": enabled, "findings": str(findings),
              "progress": str(progress), "raise_on_failure": False, "budget": budget}
    reports, log, rc = _launch(ranks, [{"name": "chunk", "target": "tests.fuzz.driver:check_seeds",
                                        "kwargs": kwargs}], timeout)
    entry = reports[0].get("chunk", {}) if reports else {}
    if entry.get("status") == "ok":
        return ast.literal_eval(entry["result"]), seeds[-1]
    running = json.loads(progress.read_text()) if progress.exists() else None
    why = "timed out (hang?)" if rc is None else f"job ended with exit {rc}"
    item = {"seed": running and running["seed"], "ranks": ranks,
            "verdict": {"status": "fail", "kind": "job", "step": -1,
                        "message": f"{why}: {log[-1500:]}"},
            "program": running and running["program"]}
    with open(findings, "a") as fh:
        fh.write(json.dumps(item) + "\n")
    return None, (running["seed"] if running else None)  # None: the job ran no program


def campaign(args) -> int:
    ranks, enabled = _ranks(args.ranks), _features(args.enable)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stats = {r: {"programs": 0, "seconds": 0.0, "counts": {}, "failures": 0} for r in ranks}
    t0, seed, per_rank = time.time(), args.start, max(1, args.programs // len(ranks))
    while any(stats[r]["programs"] < per_rank for r in ranks):
        if args.hours and time.time() - t0 > args.hours * 3600:
            break
        for r in ranks:
            n = min(args.chunk, per_rank - stats[r]["programs"])
            if n <= 0:
                continue
            seeds = list(range(seed, seed + n))
            t = time.time()
            while seeds:
                summary, last = _chunk(r, seeds, enabled, out, args.timeout, args.budget)
                done = seeds[:seeds.index(last) + 1] if last is not None else []
                s = stats[r]
                s["programs"] += len(done)
                if summary:
                    for k, v in summary["counts"].items():
                        s["counts"][k] = s["counts"].get(k, 0) + v
                    s["failures"] += summary["failures"]
                else:
                    s["failures"] += 1
                    s["counts"]["job_failed"] = s["counts"].get("job_failed", 0) + 1
                seeds = seeds[len(done):] if done else []  # a job that ran nothing: give up
            stats[r]["seconds"] += time.time() - t
        seed += args.chunk
        _report(stats, out, enabled, t0)
    _report(stats, out, enabled, t0)
    return 0


def _report(stats, out, enabled, t0):
    for s in stats.values():
        s["programs_per_hour"] = round(3600 * s["programs"] / s["seconds"]) if s["seconds"] else 0
    summary = {"enabled": enabled, "wall_seconds": round(time.time() - t0, 1),
               "per_ranks": stats, "findings_file": str(out / "findings.jsonl")}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    line = "  ".join(f"P={r}: {s['programs']} programs, {s['failures']} failing, "
                     f"{s['programs_per_hour']}/h" for r, s in stats.items())
    print(f"[{summary['wall_seconds']:.0f}s] {line}", flush=True)


def paths(args) -> int:
    """The path programs of :mod:`.paths_distributed`: one mpiexec per rank count."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    total = {}
    for r in _ranks(args.ranks):
        seeds = list(range(args.start, args.start + args.programs))
        kwargs = {"seeds": seeds, "findings": str(out / "findings.jsonl"),
                  "progress": str(out / f"progress-{r}.json"), "raise_on_failure": False,
                  "only": args.only}
        t = time.time()
        reports, log, rc = _launch(r, [{"name": "paths", "kwargs": kwargs,
                                        "target": "tests.fuzz.paths_distributed:check_path_seeds"}],
                                   args.timeout)
        entry = reports[0].get("paths", {}) if reports else {}
        summary = ast.literal_eval(entry["result"]) if entry.get("status") == "ok" else \
            {"job_failed": f"exit {rc}: {log[-1500:]}"}
        summary["wall_seconds"] = round(time.time() - t, 1)
        total[r] = summary
        print(f"P={r}: {json.dumps(summary)}", flush=True)
    (out / "summary.json").write_text(json.dumps(total, indent=1))
    return 0 if all(s.get("failures") == 0 for s in total.values()) else 1


def replay(args) -> int:
    program = json.loads(args.program)
    target = "tests.fuzz.paths_distributed:check_path_program" if "path" in program else \
        "tests.fuzz.driver:check_program"
    calls = [{"name": "replay", "target": target,
              "kwargs": {"program": program, "expect": None}}]
    reports, log, rc = _launch(_ranks(str(args.ranks))[0], calls, args.timeout)
    entry = reports[0].get("replay") if reports else None
    if not entry or entry["status"] != "ok":
        print(f"the job failed (exit {rc}):\n{log}")
        return 1
    verdict = ast.literal_eval(entry["result"])
    print(json.dumps(verdict, indent=1))
    return 0 if verdict["status"] != "fail" else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("campaign", help="run many programs on several rank counts")
    c.add_argument("--programs", type=int, default=2000, help="total over rank counts (2000)")
    c.add_argument("--ranks", default="1,2,3", help="comma list of rank counts (1,2,3)")
    c.add_argument("--enable", default="default",
                   help=f"features to add to those not known broken: 'all', 'default' (none "
                        f"added) or a comma list; known broken now: {sorted(KNOWN_BROKEN_ON_MAIN)}")
    c.add_argument("--start", type=int, default=100000, help="first seed (100000)")
    c.add_argument("--chunk", type=int, default=40, help="programs per mpiexec (40)")
    c.add_argument("--hours", type=float, default=0, help="stop after this long (0: no limit)")
    c.add_argument("--timeout", type=float, default=900, help="seconds per mpiexec (900)")
    c.add_argument("--budget", type=int, default=60, help="shrinking runs per failure (60)")
    c.add_argument("--out", default="fuzz-campaign", help="output folder (fuzz-campaign)")
    r = sub.add_parser("replay", help="run one printed program")
    r.add_argument("program", help="the program's JSON text")
    r.add_argument("--ranks", type=int, default=1, help="rank count (1)")
    r.add_argument("--timeout", type=float, default=300, help="seconds (300)")
    pa = sub.add_parser("paths", help="the path programs of tests.fuzz.paths_distributed "
                                      "(user networks, clipping, dropout, BatchNorm, threads)")
    pa.add_argument("--programs", type=int, default=60, help="programs per rank count (60)")
    pa.add_argument("--ranks", default="1,2,3", help="comma list of rank counts (1,2,3)")
    pa.add_argument("--start", type=int, default=360000, help="first seed (360000)")
    pa.add_argument("--timeout", type=float, default=1800, help="seconds per mpiexec (1800)")
    pa.add_argument("--out", default="fuzz-paths", help="output folder (fuzz-paths)")
    pa.add_argument("--only", default=None, help="programs of this path only (e.g. ptie)")
    args = ap.parse_args(argv)
    return {"campaign": campaign, "paths": paths}.get(args.cmd, replay)(args)


if __name__ == "__main__":
    sys.exit(main())
