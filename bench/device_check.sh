#!/usr/bin/env bash
# Device check (prepared for a lent GPU host with 16 cores; about 8 minutes): the CUDA sink
# (bench/gpu_check.sh) and the line-rate table for K = 1, 2, 4, 8 cores (bench/line_rate.py,
# p2pw beside the raw programs, each process pinned to K CPUs, the defaults following K).
# Everything it prints also lands under $OUT (gpu.log, line_rate.md, line_rate.json).
#
#   bash bench/device_check.sh            (from the repository root)
#
# That host's image has torch, numpy, xxhash and safetensors but no pyzmq: carry it as a wheel in
# .whl (git-ignored), made here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl pyzmq==27.3.0
set -uo pipefail
OUT=${OUT:-/tmp/p2pw-device-check}
mkdir -p "$OUT"
if ! python3 -c "import zmq" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/p2pw-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/p2pw-site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
{ nproc; uname -r; python3 -c "import zmq, torch; print('pyzmq', zmq.__version__, 'libzmq', zmq.zmq_version(), 'torch', torch.__version__)"; } | tee "$OUT/host.txt"

PY=python3 timeout 200 bash bench/gpu_check.sh 2048 2>&1 | tee "$OUT/gpu.log"

where=disk
free_shm=$(df --output=avail -B1 /dev/shm 2>/dev/null | tail -1)
[ "${free_shm:-0}" -gt $((4 << 30)) ] && where=disk,tmpfs  # a 1 GiB source and two copies
timeout 330 python3 bench/line_rate.py --sizes 1GiB --where "$where" --cores 1,2,4,8 --repeat 3 \
  --json "$OUT/line_rate.json" 2>&1 | tee "$OUT/line_rate.md"
