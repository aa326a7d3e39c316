"""The one command that regenerates every table in ``experiments/results/`` at one commit.

Usage (from the repository root, after committing the code the tables are to record)::

    python experiments/regenerate.py --full                  # the record: every script, every part
    python experiments/regenerate.py --full --part accuracy  # what does not need a quiet machine
    python experiments/regenerate.py --full --part timing    # wall times: run on a quiet machine
    python experiments/regenerate.py --full --resume         # continue a record run at this commit
    python experiments/regenerate.py --quick --out /tmp/x    # CI smoke: every script's quick mode
    python experiments/regenerate.py --quick --only kirby layerwise --jobs 2
    python experiments/regenerate.py --list                  # the registry and the commands
    python experiments/regenerate.py --readme-only           # README block from stored results

Every script of :data:`REGISTRY` is launched as its own process (MPI scripts as
``OMP_NUM_THREADS=1 mpiexec -n K python -m mpi4py SCRIPT``; the venv's mpiexec, or
``$LAYERPAR_MPIEXEC``). ``--full`` writes into ``experiments/results`` (``--out`` to redirect) and
then rebuilds the generated block of ``experiments/README.md`` from the studies'
``headline.json`` files; ``--quick`` writes into a temporary folder (or ``--out``) and never
touches the committed results. Each run leaves ``MANIFEST.md`` (and ``manifest.json``) in the
output folder: per script the exact command, exit status, seconds, and the commit of the tree.

Kinds of scripts (``Entry.kind``): ``accuracy`` (deterministic or load-independent results:
run by ``--part accuracy``), ``timing`` (benchmarks: ``--part timing``), ``mixed`` (accuracy and
wall times come from one run: both parts), ``parts`` (the script has ``--part accuracy|timing``
and keeps the other part's stored results: each ``--part`` runs only its own). A registered
script that does not exist yet is skipped (listed as ``missing``): other helpers' scripts join
by existing; a script without a quick mode (``quick=None``) is listed as such in quick runs.

The results mirror the scripts' folders: a script in ``experiments/<room>/`` (``benchmarks``,
``reproductions``, ``studies``, ``records``) gets ``<out>/<room>`` as its output base, so its
study lands in ``experiments/results/<room>/<study>/``; ``MANIFEST.md``, ``manifest.json`` and
``logs/`` stay at the top of the output folder.

Statuses in the manifest: ``ok`` (exit 0), ``skip (<reason>)`` (the script ran and did nothing
on this machine: it exited with :data:`mgrit.reporting.writers.EXIT_SKIP`, 75, after printing
``SKIP: <reason>``, e.g. a GPU benchmark without a GPU), ``failed (<exit status>)``,
``missing (...)`` (a registered script that does not exist) and ``not run (...)`` (not in this
mode or part). The generated README block lists the scripts of the last run that were ``skip``.

A record run may span several sittings at one commit: ``--full --only A B`` and ``--full
--resume`` merge their rows into the output folder's existing ``manifest.json`` instead of
replacing it (a row per script, the latest run of each, each row with the ``commit`` it ran
at), and ``--resume`` launches only the scripts without an ``ok`` or ``skip`` row at the
current commit. The manifest's ``commit`` is the rows' common commit, or ``mixed (...)`` when
they differ; ``total_seconds`` is the sum of the rows' durations (the record's run time).

Exit status: 0 when no launched script failed (``skip`` is not a failure), 1 otherwise.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mgrit.reporting import writers as reporting  # noqa: E402

README = ROOT / "experiments" / "README.md"
BEGIN, END = "<!-- BEGIN GENERATED: regenerate.py -->", "<!-- END GENERATED: regenerate.py -->"
KINDS = ("accuracy", "timing", "mixed", "parts")


@dataclass(frozen=True)
class Entry:
    """One script: ``{out}`` in the argument lists is the script's output base folder
    (``<out>/<room>``, the results mirroring the script's folder)."""
    name: str
    script: str                  # path relative to the repository root
    ranks: int | None            # None: plain python; K: mpiexec -n K python -m mpi4py
    full: tuple[str, ...]        # arguments of the record run
    quick: tuple[str, ...] | None  # arguments of the CI smoke run (None: none yet)
    kind: str
    owner: str
    timeout: int = 6 * 3600      # seconds, record run
    quick_timeout: int = 600

    @property
    def room(self) -> str:
        """The script's folder under ``experiments/`` (``reproductions``, ...): its results go to
        ``<out>/<room>``."""
        return Path(self.script).parent.name


REGISTRY: tuple[Entry, ...] = (
    Entry("kirby2020", "experiments/reproductions/reproduce_kirby.py", 2, ("--full", "--out", "{out}"),
          ("--smoke", "--out", "{out}"), "parts", "P3"),
    Entry("guenther2020", "experiments/reproductions/reproduce_guenther.py", 2, ("--full", "--out", "{out}"),
          ("--smoke", "--out", "{out}"), "mixed", "P3"),
    Entry("torchbraid_mnist", "experiments/reproductions/reproduce_torchbraid.py", 2,
          ("--full", "--out", "{out}"), ("--smoke", "--out", "{out}"), "mixed", "P3"),
    Entry("layerwise", "experiments/reproductions/reproduce_layerwise.py", 2, ("--full", "--out", "{out}"),
          ("--smoke", "--out", "{out}"), "parts", "P3"),
    Entry("convergence", "experiments/studies/study_convergence.py", 2, ("--full", "--out", "{out}"),
          ("--smoke", "--out", "{out}"), "accuracy", "P3"),
    Entry("bench_pymgrit", "experiments/benchmarks/bench_pymgrit.py", None,
          ("--out", "{out}/bench_pymgrit.md"),
          ("--quick", "--ranks", "1", "--cases", "dahlquist-L2", "heat-L5", "--out",
           "{out}/bench_pymgrit.md"), "timing", "P3"),
    Entry("bench_gpu", "experiments/benchmarks/bench_gpu.py", None, ("--out", "{out}"),
          ("--dry-run", "--out", "{out}/gpu_dry_run"), "timing", "P3"),
    Entry("gpu_check", "experiments/benchmarks/gpu_check.py", None, (), ("--dry-run",), "accuracy", "P3"),
    # other helpers' scripts: they join the command by existing; their CLIs as of this commit
    Entry("bench_layerparallel", "experiments/benchmarks/bench_layerparallel.py", None,
          ("--out", "{out}/bench_layerparallel.md"),
          ("--quick", "--out", "{out}/bench_layerparallel.md"), "timing", "perf helper"),
    Entry("bench_dataparallel", "experiments/benchmarks/bench_dataparallel.py", None,
          ("--out", "{out}/bench_dataparallel.md"), None, "timing", "perf helper"),
    Entry("plan", "experiments/benchmarks/plan.py", None, ("--layers", "4096", "--ranks", "64"), None,
          "timing", "perf helper"),
    Entry("plan_validation", "experiments/benchmarks/plan.py", None,
          ("--validate", "--out", "{out}/plan_validation.md"),
          ("--validate", "--quick", "--out", "{out}/plan_validation.md"), "timing", "perf helper"),
    Entry("bench_data", "experiments/benchmarks/bench_data.py", None, ("--out", "{out}/data_throughput.md"),
          None, "timing", "G4"),
    Entry("bench_transformer", "experiments/benchmarks/bench_transformer.py", None, ("--out", "{out}"),
          ("--smoke", "--out", "{out}"), "timing", "transformer helper"),
    Entry("bench_gru", "experiments/benchmarks/bench_gru.py", None, ("--full", "--out", "{out}"),
          ("--smoke", "--out", "{out}"), "timing", "GRU helper"),
    # the fast paths' per-call contract check (its raw per-repeat numbers beside the table)
    Entry("bench_fingerprint", "experiments/benchmarks/bench_fingerprint.py", None,
          ("--out", "{out}"), ("--smoke", "--out", "{out}"), "timing", "fingerprint helper"),
    # issue 34 item 1: the MGRIT training step phase by phase, per rank, with its bound
    # (N = 1024, m = 16/32/64; a load gate marks loaded runs unreliable); the per-layer step
    # with per-tensor SGD and the stacked-leaf step with foreach SGD, interleaved
    Entry("profile_step_p1", "experiments/benchmarks/profile_step.py", None,
          ("--compile", "--modes", "layers:sgd", "stacked:foreach", "--out", "{out}"),
          ("--quick", "--modes", "layers:sgd", "stacked:foreach", "--out", "{out}"), "timing",
          "perf helper (issue 34)"),
    Entry("profile_step_p2", "experiments/benchmarks/profile_step.py", 2,
          ("--compile", "--modes", "layers:sgd", "stacked:foreach", "--out", "{out}"),
          ("--quick", "--modes", "layers:sgd", "stacked:foreach", "--out", "{out}"), "timing",
          "perf helper (issue 34)"),
    # named as its results folder (studies/multilevel/), so that its headline.json reaches the
    # README block (issue 24 item 2; it was "study_multilevel")
    Entry("multilevel", "experiments/studies/study_multilevel.py", 2, ("--full", "--out", "{out}"),
          ("--smoke", "--out", "{out}"), "mixed", "multilevel helper"),
    # the main job's records: its acceptance (G3) and issues 15 and 18 (the scripts launch
    # their 2-rank jobs)
    Entry("mnist_mgrit_vs_serial", "experiments/records/compare_mainjob.py", None,
          ("--full", "--out", "{out}"), ("--smoke", "--out", "{out}"), "mixed", "G3 (main job)"),
    Entry("transformers", "experiments/records/transformer_records.py", None, ("--full", "--out", "{out}"),
          ("--smoke", "--out", "{out}"), "mixed", "transformer helper"),
    Entry("gru", "experiments/studies/study_gru.py", None, ("--full", "--out", "{out}"),
          ("--smoke", "--out", "{out}"), "mixed", "GRU helper"),
    Entry("bias_monitor", "experiments/studies/study_bias.py", 2, ("--out", "{out}"),
          ("--smoke", "--out", "{out}"), "accuracy", "bias helper"),
    # issue 23: BatchNorm ResNet and dropout ViT, weight-tied vs untied ResNet (serial vs
    # layer-parallel, 3 seeds; the script launches its 2-rank jobs)
    Entry("batchnorm_dropout", "experiments/records/stateful_records.py", None,
          ("--study", "batchnorm_dropout", "--full", "--out", "{out}"),
          ("--study", "batchnorm_dropout", "--smoke", "--out", "{out}"), "mixed", "h8 (issue 23)"),
    Entry("tied_resnet", "experiments/records/stateful_records.py", None,
          ("--study", "tied_resnet", "--full", "--out", "{out}"),
          ("--study", "tied_resnet", "--smoke", "--out", "{out}"), "mixed", "h8 (issue 23)"),
    # issue 24 item 5: traces of the real run at P = 1..16 (oversubscribed), replayed (the
    # script launches its own mpiexec jobs); hS: calibrated host work, validation at P = 1, 2,
    # modeled strong/weak curves to P = 256; issue 34.5: CPU time, paired repeats, the P1 -> P2
    # ratio on 3 networks (full: estimate 4-6 min on 2 idle cores, not measured quiet)
    Entry("scaling_replay", "experiments/studies/scaling_replay.py", None, ("--out", "{out}"),
          ("--smoke", "--out", "{out}"), "mixed", "h24a (issue 24)"),
    # issue 24 item 1: time to a fixed validation accuracy, serial (eager, compiled), data
    # parallel, GPipe, MGRIT with the bias monitor, 2 ranks, 5 seeds (task hT)
    Entry("time_to_accuracy", "experiments/studies/time_to_accuracy.py", 2,
          ("--full", "--out", "{out}"), ("--smoke", "--out", "{out}"), "mixed", "hT (issue 24)"),
    # issue 24 item 4: the frozen planner's regret on 12 networks drawn at random (P = 2; the
    # script launches its 2-rank jobs)
    Entry("plan_unseen", "experiments/benchmarks/plan_unseen.py", None, ("--out", "{out}"),
          ("--smoke", "--out", "{out}"), "timing", "hP (issue 24)"),
    # issue 35 item 3: spatial coarsening in space-time MGRIT -- convergence factors, gradient
    # error, CPU cost per cycle and step (1 process, 2 ranks), the training record (the script
    # launches its 2-rank measurement and the main job's runs)
    Entry("spatial_coarsening", "experiments/studies/study_spatial.py", None,
          ("--full", "--out", "{out}"), ("--quick", "--out", "{out}"), "mixed",
          "spatial_job (issue 35)"),
    # issue 34 item 2: MGRIT step vs the strongest baseline (lean, compiled lean, lean DP,
    # torch.distributed.pipelining), N x width at P = 2 (full: 5 repeats, ~5-10 min quiet)
    Entry("regime_map", "experiments/studies/regime_map.py", 2, ("--full", "--out", "{out}"),
          ("--smoke", "--out", "{out}"), "timing", "baselines (issue 34)", timeout=3600),
)


def mpiexec() -> str:
    return os.environ.get("LAYERPAR_MPIEXEC") or str(Path(sys.executable).parent / "mpiexec")


def command(e: Entry, mode: str, part: str, out: Path) -> list[str] | None:
    """The command line of ``e`` in ``mode`` (``quick``/``full``) and ``part``; None when the
    entry does not run in this mode/part."""
    args = e.quick if mode == "quick" else e.full
    if args is None:
        return None
    if part != "all":
        if e.kind == "parts":
            args = (*args, "--part", part)
        elif e.kind not in (part, "mixed"):
            return None
    args = [a.replace("{out}", str(out / e.room)) for a in args]
    head = [sys.executable] if e.ranks is None else [mpiexec(), "-n", str(e.ranks),
                                                    sys.executable, "-m", "mpi4py"]
    return head + [str(ROOT / e.script)] + args


def status(rc: int | str, log: str) -> str:
    """The manifest status of an exit status ``rc`` (``"timeout"`` when killed) and the
    script's output ``log``: ``ok``, ``skip (<reason>)`` for :data:`reporting.EXIT_SKIP` (the
    reason: the last ``SKIP:`` line of the log), or ``failed (<rc>)``."""
    if rc == 0:
        return "ok"
    if rc == reporting.EXIT_SKIP:
        why = [ln[len("SKIP:"):].strip() for ln in log.splitlines() if ln.startswith("SKIP:")]
        return f"skip ({why[-1] if why else 'no reason printed'})"
    return f"failed ({rc})"


def _run(e: Entry, cmd: list[str], timeout: int, logdir: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    log = logdir / f"{e.name}.log"
    meta = reporting.run_metadata(cmd)
    commit, date = meta["commit"], meta["date"]
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return {"name": e.name, "command": " ".join(cmd),
            "status": status(rc, log.read_text(errors="replace")),
            "seconds": round(time.perf_counter() - t0, 1), "log": str(log), "kind": e.kind,
            "owner": e.owner, "commit": commit, "date": date}


def run_all(mode: str, part: str, out: Path, only: Sequence[str] | None, jobs: int,
            registry: Sequence[Entry] = REGISTRY, done: frozenset = frozenset()) -> list[dict]:
    """Run the selected entries of ``registry`` (default :data:`REGISTRY`; ``jobs`` at a
    time) except those named in ``done`` (already recorded: ``--resume``); returns one record
    per launched or unlaunchable entry, in registry order."""
    out.mkdir(parents=True, exist_ok=True)
    logdir = out / "logs"
    logdir.mkdir(exist_ok=True)
    records, todo = [], []
    for e in registry:
        if (only and e.name not in only) or e.name in done:
            continue
        base = {"name": e.name, "kind": e.kind, "owner": e.owner, "seconds": 0.0, "command": ""}
        if not (ROOT / e.script).is_file():
            records.append(dict(base, status=f"missing ({e.script} does not exist yet)"))
            continue
        cmd = command(e, mode, part, out)
        if cmd is None:
            why = "no quick mode yet" if mode == "quick" and e.quick is None else f"not in part {part}"
            records.append(dict(base, status=f"not run ({why})"))
            continue
        todo.append((e, cmd, e.quick_timeout if mode == "quick" else e.timeout))
    with cf.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futs = [pool.submit(_run, e, cmd, t, logdir) for e, cmd, t in todo]
        for f in futs:
            r = f.result()
            print(f"[{r['status']}] {r['name']} ({r['seconds']} s): {r['command']}", flush=True)
            records.append(r)
    order = {e.name: i for i, e in enumerate(registry)}
    return sorted(records, key=lambda r: order[r["name"]])


def merged(previous: list[dict], records: list[dict],
           registry: Sequence[Entry] = REGISTRY) -> list[dict]:
    """``previous`` manifest rows with those of ``records`` replacing the same script's row,
    in registry order (rows of scripts no longer registered are dropped)."""
    rows = {r["name"]: r for r in previous}
    rows.update({r["name"]: r for r in records})
    return [rows[e.name] for e in registry if e.name in rows]


def resumable(out: Path, commit: str, part: str = "all") -> frozenset:
    """Names of the scripts with an ``ok`` or ``skip`` row at ``commit`` in ``out``'s
    ``manifest.json`` from a run of ``part`` or of every part (empty when there is none)."""
    f = out / "manifest.json"
    if not f.is_file():
        return frozenset()
    return frozenset(r["name"] for r in json.loads(f.read_text())["records"]
                     if r.get("commit") == commit and r.get("part", "all") in (part, "all")
                     and (r["status"] == "ok" or r["status"].startswith("skip")))


def manifest_commit(records: list[dict], fallback: str) -> str:
    """The rows' common commit; ``mixed (a, b)`` when they differ; ``fallback`` when no row
    names one."""
    commits = sorted({r["commit"] for r in records if r.get("commit")})
    if not commits:
        return fallback
    return commits[0] if len(commits) == 1 else f"mixed ({', '.join(commits)})"


def write_manifest(out: Path, records: list[dict], mode: str, part: str,
                   meta: dict | None = None) -> None:
    """``MANIFEST.md`` and ``manifest.json`` of a run: ``meta`` (the run's
    :func:`reporting.run_metadata`, taken when it started; default: now) completed with the load
    after, and one row per record."""
    meta = reporting.finish_metadata(meta if meta is not None else reporting.run_metadata())
    meta["commit"] = manifest_commit(records, meta["commit"])
    parts = {r.get("part", part) for r in records}
    meta["part"] = parts.pop() if len(parts) == 1 else "mixed"
    meta["total_seconds"] = round(sum(float(r.get("seconds") or 0) for r in records), 1)
    rows = [[r["name"], r["kind"], r["owner"], r["status"], r["seconds"], r.get("commit", ""),
             r.get("date", ""), f"`{r['command']}`"] for r in records]
    body = (f"Mode `{mode}`, part `{meta['part']}`. Run time, the sum of the scripts' durations: "
            f"{meta['total_seconds'] / 60:.1f} min. Timing-sensitive kinds (`timing`, `mixed`, "
            "the `timing` part of `parts`) are valid only from a quiet machine.\n\n"
            + reporting.markdown_table(["script", "kind", "owner", "status", "seconds", "commit",
                                        "date", "command"], rows))
    reporting.write_table(out / "MANIFEST.md", "Results regenerated by experiments/regenerate.py",
                          meta, body)
    (out / "manifest.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))


def skipped_line(results: Path) -> str:
    """The README's line naming the scripts that were ``skip`` in the run of
    ``results/manifest.json`` (empty when none, or no manifest)."""
    f = results / "manifest.json"
    if not f.is_file():
        return ""
    recs = [r for r in json.loads(f.read_text())["records"] if r["status"].startswith("skip")]
    if not recs:
        return ""
    return ("Did nothing in the last run (`skip`, no result from this machine): "
            + "; ".join(f"`{r['name']}` {r['status'][len('skip '):]}" for r in recs) + ".")


#: The top README's generated block: the headline rows of the records that answer a user's
#: first question (is it faster, and is it as accurate), the places we lose included.
TOP_README = ROOT / "README.md"
TOP_BEGIN, TOP_END = "<!-- BEGIN GENERATED: results -->", "<!-- END GENERATED: results -->"
TOP_STUDIES = ("time_to_accuracy", "regime_map", "plan_unseen", "scaling_replay", "mnist_mgrit_vs_serial",
               "transformers", "kirby2020", "guenther2020")


def _gated(row: dict) -> str:
    """A headline row's numbers, or a mark for a row whose kind says its timing was unreliable
    (:func:`experiments.measure.load_gate`) or its model not validated: such numbers never
    enter a README."""
    kind = str(row.get("kind", ""))
    if "unreliable" in kind:
        return "not shown: timed while the load exceeded the job's processes + 0.5 (load gate)"
    if "not validated" in kind:
        return "not shown: modeled by a model that is not validated (not a result)"
    return row["ours"]


def readme_block(results: Path, names: Sequence[str] | None = None, prefix: str = "") -> str:
    """The generated block of experiments/README.md: every study's headline rows (written by
    the study from its results) with the commit of the run that produced them, then
    :func:`skipped_line`; with ``names``, only those registry entries' rows, in that order,
    and no skipped line (the top README's block); ``prefix`` goes before every link (the top
    README: ``experiments/``)."""
    rows = []
    entries = REGISTRY if names is None else [e for n in names for e in REGISTRY if e.name == n]
    for e in entries:
        # a study folder (results/<name>/headline.json + summary.md) or a benchmark table
        # (results/<name>.headline.json beside results/<name>.md)
        room = results / e.room
        for f, link in ((room / e.name / "headline.json", f"results/{e.room}/{e.name}/summary.md"),
                        (room / f"{e.name}.headline.json", f"results/{e.room}/{e.name}.md")):
            if f.is_file():
                h = json.loads(f.read_text())
                rows += [[f"[{e.name}]({prefix}{link})", r["claim"], _gated(r),
                          r.get("kind", "measured"), ", ".join(h["commits"])] for r in h["rows"]]
    skipped = skipped_line(results) if names is None else ""
    if not rows:
        return "\n\n".join(x for x in ("No study has written headline.json yet.", skipped) if x)
    table = reporting.markdown_table(["study", "published claim / question", "ours",
                                      "kind", "commit of the run"], rows)
    return table + (f"\n\n{skipped}" if skipped else "")


def _replace_block(path: Path, begin: str, end: str, block: str) -> None:
    text = path.read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"{path} has no generated block ({begin} ... {end})")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(head + begin + "\n" + block + "\n" + end + tail)


def update_readme(results: Path) -> None:
    """Rebuild the generated blocks of experiments/README.md (:func:`readme_block`) and of the
    top README (the rows of :data:`TOP_STUDIES`)."""
    _replace_block(README, BEGIN, END, readme_block(results))
    _replace_block(TOP_README, TOP_BEGIN, TOP_END, readme_block(results, TOP_STUDIES, "experiments/"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--full", action="store_true", help="the record (default)")
    mode.add_argument("--quick", "--smoke", action="store_true", help="CI smoke, temporary output")
    mode.add_argument("--list", action="store_true", help="print the registry and exit")
    mode.add_argument("--readme-only", action="store_true",
                      help="rebuild the generated block of experiments/README.md from the "
                           "headline.json files in experiments/results, run nothing")
    ap.add_argument("--part", choices=("all", "accuracy", "timing"), default="all")
    ap.add_argument("--only", nargs="+", default=None, help="registry names")
    ap.add_argument("--out", default=None,
                    help="output base folder (default: experiments/results; --quick: a temp folder)")
    ap.add_argument("--jobs", type=int, default=1, help="scripts run at once (default 1)")
    ap.add_argument("--resume", action="store_true",
                    help="--full only: keep the output folder's manifest rows and launch only "
                         "the scripts without an ok/skip row at the current commit (a record "
                         "run in several sittings)")
    a = ap.parse_args(argv)
    names = {e.name for e in REGISTRY}
    for n in a.only or ():
        if n not in names:
            raise SystemExit(f"--only {n}: not in the registry ({', '.join(sorted(names))})")
    m = "quick" if a.quick else "full"
    if a.resume and m != "full":
        raise SystemExit("--resume continues a --full record run; it does not apply to --quick")
    if a.jobs < 1:
        raise SystemExit(f"--jobs {a.jobs}: need at least 1 script at a time")
    if a.list:
        for e in REGISTRY:
            cmd = command(e, "full", "all", Path("experiments/results"))
            print(f"{e.name:24s} {e.kind:9s} {e.owner:20s} "
                  f"{'(missing) ' if not (ROOT / e.script).is_file() else ''}{' '.join(cmd or [])}")
        return 0
    if a.readme_only:
        update_readme(ROOT / "experiments" / "results")
        return 0
    if a.out is not None:
        out = Path(a.out)
    else:
        out = Path(tempfile.mkdtemp(prefix="layerpar_quick_")) if a.quick else ROOT / "experiments" / "results"
    meta = reporting.run_metadata()
    done = resumable(out, meta["commit"], a.part) if a.resume else frozenset()
    records = [dict(r, part=a.part) for r in run_all(m, a.part, out, a.only, a.jobs, done=done)]
    if m == "full" and (a.resume or a.only) and (out / "manifest.json").is_file():
        previous = json.loads((out / "manifest.json").read_text())
        # rows written before rows named their commit ran at the manifest's commit
        old = [dict(r, commit=r.get("commit") or previous["meta"]["commit"])
               for r in previous["records"]]
        records = merged(old, records)
    write_manifest(out, records, m, a.part, meta)
    if m == "full" and out.resolve() == (ROOT / "experiments" / "results").resolve():
        update_readme(out)
    failed = [r["name"] for r in records if r["status"].startswith("failed")]
    print(f"wrote {out / 'MANIFEST.md'}" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
