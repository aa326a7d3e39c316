"""Second GPU run of a session (issue 38): MGRIT's coarsening against the strongest serial.

After ``gpu_session.py`` showed batched MGRIT beating serial eager but not the lean loop under a
CUDA graph, this measures, for the dense ResNet (width 8, batch 64, float32; N = 1024, 4096):

* MGRIT forward and training step (2 forward / 1 adjoint cycles, relax F, fixed cycles) for
  several (levels, cfactor m), with the forward's relative error against serial;
* the lean loop under a CUDA graph again (a second measurement of the same version: the
  run-to-run spread against ``gpu_session.json``);
* where the MGRIT forward synchronizes with the host (``torch.cuda.set_sync_debug_mode``),
  the reason its capture in a CUDA graph fails.

Usage: ``python experiments/benchmarks/gpu_sweep.py --out DIR [--device cpu]``; writes
``DIR/gpu_sweep.json`` and prints a table.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from experiments.benchmarks.gpu_concurrency import LR, _graph, _models, _rel, _train, timeit  # noqa: E402
from experiments.benchmarks.gpu_session import provenance  # noqa: E402
from mgrit.reporting import writers  # noqa: E402

SWEEP = [(2, 16), (2, 32), (2, 64), (2, 128), (3, 8), (3, 16)]


def sync_site(n, width, m, dev):
    """The first host synchronization in an MGRIT forward: the mgrit frames of its stack."""
    lp, _, _ = _models(n, width, m, dev)
    x = torch.randn(64, width, device=dev)
    with torch.no_grad():
        lp(x)
        torch.cuda.synchronize(dev)
        torch.cuda.set_sync_debug_mode("error")
        try:
            lp(x)
            return {"sync": None}
        except Exception as e:  # noqa: BLE001 -- the point of the check
            frames = [f"{f.filename.split('/work/main/.gpu/')[-1]}:{f.lineno} {f.name}: {f.line}"
                      for f in traceback.extract_tb(e.__traceback__) if "mgrit" in f.filename]
            return {"sync": f"{type(e).__name__}: {str(e)[:200]}", "frames": frames[-8:]}
        finally:
            torch.cuda.set_sync_debug_mode(0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("FAIL: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    quick = dev.type == "cpu"
    t0 = time.time()
    meta = provenance(dev)
    res = {"meta": meta, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "rows": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for n in ((64,) if quick else (1024, 4096)):
        for levels, m in (SWEEP[:2] if quick else SWEEP):
            if n // m ** (levels - 1) < 2:
                continue
            lp, ser, lean = _models(n, 8, m, dev, levels=levels)
            x = torch.randn(64, 8, device=dev)
            with torch.no_grad():
                err = _rel(lp(x), ser(x))
            row = {"N": n, "levels": levels, "m": m, "fwd_rel_err": err}

            def fwd():
                with torch.no_grad():
                    lp(x)
            row["fwd"] = timeit(fwd, dev)
            row["train"] = timeit(_train(lp, torch.optim.SGD(lp.parameters(), lr=LR, foreach=True), x), dev)
            if dev.type == "cuda" and (levels, m) == (2, 64):
                g, _ = _graph(lambda: lean.forward(x), dev)
                gt, _ = _graph(lambda: lean.train_step(x, LR), dev)
                row["lean_graph_again"] = {"fwd": timeit(g.replay, dev), "train": timeit(gt.replay, dev)}
            res["rows"].append(row)
            print(f"N={n} L={levels} m={m}: fwd {row['fwd']['median_s']*1e3:.2f} ms train "
                  f"{row['train']['median_s']*1e3:.2f} ms err {err:.2e}", flush=True)
            (out / "gpu_sweep.json").write_text(json.dumps(res, indent=1))
    if dev.type == "cuda":
        res["sync_site"] = sync_site(1024, 8, 32, dev)
        print(json.dumps(res["sync_site"], indent=1))
    res["wall_s"] = time.time() - t0
    res["meta"] = writers.finish_metadata(meta)
    (out / "gpu_sweep.json").write_text(json.dumps(res, indent=1))
    print(f"wrote {out / 'gpu_sweep.json'} in {res['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
