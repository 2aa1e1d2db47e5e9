#!/bin/bash
# The GPU machine's whole check (issue 22), in one call of about six minutes:
#   bash bench/gpu/run_device.sh OUTDIR [SECTION ...]   (default: every section)
# (the lent H200 ran: facts kernels tests memory zero; then kernels tests memory; then memory4)
# run from the repository root there, with the device's python3 (its own torch with
# CUDA) and plait from src/. Sections are independent: one that fails or runs out of
# its time leaves the others' results. Everything lands in OUTDIR (at most 8 files).
set -u
out=${1:?usage: run_device.sh OUTDIR [facts kernels tests memory memory4 zero]}
shift
sections=${*:-facts kernels tests memory memory4 zero}
wanted() { [[ " $sections " == *" $1 "* ]]; }
here=$(pwd)
export PYTHONPATH=$here/src:$here${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
log=$out/log.txt
section() { echo "=== $1 ($(date +%T))" | tee -a "$log"; }

section facts
{ nvidia-smi; python3 -c "import torch, plait; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), 'tf32 matmul', torch.backends.cuda.matmul.allow_tf32)"; } >>"$log" 2>&1

if wanted kernels; then
section kernels
timeout 170 python3 bench/gpu/kernels.py --out "$out/kernels.json" >>"$log" 2>&1 || echo "kernels: exit $?" | tee -a "$log"
fi

if wanted tests; then
section tests
timeout 200 python3 -m pytest -q -p no:cacheprovider --timeout 120 tests/gpu >"$out/tests.txt" 2>&1 || echo "tests: exit $?" | tee -a "$log"
tail -5 "$out/tests.txt" | tee -a "$log"
fi

if wanted memory; then
section memory
# recompute x offload under bf16 at dp2 x pp2, 4 processes sharing the GPU over gloo:
# torch.cuda.max_memory_allocated and the saved activations against plait's formula
timeout 150 python3 -m plait bench memory --backend gloo --meshes 2x1x2 --precisions bf16-mixed --offload both \
    --seq-len 1024 --layers 4 --hidden 512 --heads 8 --global-batch 8 --micro-batch 2 --steps 3 --no-peers \
    --out /tmp/plait-memory --json "$out/memory.json" >>"$log" 2>&1 || echo "memory: exit $?" | tee -a "$log"
fi

if wanted memory4; then
section memory4
# the same at 4 micro-batches per rank (offload keeps two resident, so it shows here),
# and one fp32 run: checks the CUDA autocast accounting fitted on the first sweep
timeout 130 python3 -m plait bench memory --backend gloo --meshes 2x1x2 --precisions bf16-mixed --offload both \
    --seq-len 1024 --layers 4 --hidden 512 --heads 8 --global-batch 16 --micro-batch 2 --steps 3 --no-peers \
    --out /tmp/plait-memory4 --json "$out/memory4.json" >>"$log" 2>&1 || echo "memory4: exit $?" | tee -a "$log"
timeout 40 python3 -m plait bench memory --backend gloo --meshes 2x1x2 --precisions fp32 --recompute none \
    --offload off --seq-len 1024 --layers 4 --hidden 512 --heads 8 --global-batch 16 --micro-batch 2 --steps 3 \
    --no-peers --out /tmp/plait-memory4-fp32 --json "$out/memory4-fp32.json" >>"$log" 2>&1 \
    || echo "memory4 fp32: exit $?" | tee -a "$log"
fi

if wanted zero; then
section zero
# ZeRO stages 0-3 at dp2 on the shared GPU (optimizer offload from a GPU is not built: ZeRO refuses it)
for stage in 0 1 2 3; do
    timeout 60 python3 -m plait train --backend gloo --dp 2 --pp 1 --zero-stage "$stage" \
        --layers 4 --hidden 1024 --heads 8 --seq-len 512 --global-batch 8 --micro-batch 2 --steps 3 \
        --eval-interval 0 --checkpoint-interval 0 --sample-chars 0 --resume never --force-fresh \
        --out "/tmp/plait-zero-$stage" >>"$log" 2>&1 || echo "zero $stage: exit $?" | tee -a "$log"
done
python3 - "$out/zero.json" <<'PY' >>"$log" 2>&1
import json, sys
from pathlib import Path
rows = {}
for path in sorted(Path("/tmp").glob("plait-zero-*/report.json")):
    report = json.loads(path.read_text())
    rows[path.parent.name] = {"memory": report.get("memory"), "run": report.get("run"),
                              "throughput": report.get("throughput")}
Path(sys.argv[1]).write_text(json.dumps(rows, indent=1))
print("zero runs:", ", ".join(rows))
PY
fi
section done
