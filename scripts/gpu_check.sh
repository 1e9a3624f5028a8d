#!/usr/bin/env bash
# The device check, in one call on a lent GPU machine (../shared/tools/gpu/README.md):
#   here, once:     bash ../shared/tools/gpu/prepare.sh
#   device call 1:  source .gpu/there.sh a && nvidia-smi -L
#                   (carry [".gpu/whl", ".gpu/pa", ".gpu/there.sh"])
#   device call 2, at once:  source .gpu/there.sh b && bash scripts/gpu_check.sh
#                   (carry [".gpu/whl", ".gpu/pb", ".gpu/there.sh"], timeout_s 600)
# It writes into the folder given (default: $OUT, which comes back from the device):
#   env.txt          versions, the GPU, what is in use on it and by whom
#   interpreter.txt  the Triton interpreter running the decode kernel on this triton and numpy
#   dry/, dry.log    gpu-check's dry run at tiny sizes (about a minute): a broken script stops here
#   gpu_check.json   the bench's gpu-check (engine/bench/gpu.py), rewritten after every section, so
#                    a run cut short keeps what it measured; gpu_check.log beside it
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-check-results}}"
py="${PYTHON:-python3}"
mkdir -p "$out"
{
  $py -c 'import numpy, torch, transformers, triton
print("torch", torch.__version__, "triton", triton.__version__, "numpy", numpy.__version__,
      "transformers", transformers.__version__)
print(torch.cuda.get_device_name(), "free, total bytes:", torch.cuda.mem_get_info())'
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv
} > "$out/env.txt" 2>&1
TRITON_INTERPRET=1 timeout 60 $py - > "$out/interpreter.txt" 2>&1 <<'PY'
import torch
from engine.cache.kv_cache import LayerCache
from engine.kernels.paged_attention import paged_decode_attention
# 40 keys in partitions of 16: a loop with a runtime bound in both kernels (the merge's too)
cache = LayerCache(torch.randn(20, 4, 2, 16), torch.randn(20, 4, 2, 16), None, None)
out = paged_decode_attention(torch.randn(2, 1, 4, 16), cache, torch.arange(20, dtype=torch.int32).view(2, 10),
                             torch.tensor([40, 9], dtype=torch.int32), 0.25, max_context_len=40,
                             partition_size=16, block_n=16)
print("the interpreter ran the decode kernel; finite:", bool(out.isfinite().all()))
PY
echo "interpreter: exit $? ($(tail -n 1 "$out/interpreter.txt"))"
timeout 100 $py -m engine.bench gpu-check --dry-run --compile off --out "$out/dry" --json > /dev/null 2> "$out/dry.log"
echo "dry run: exit $?"
timeout 430 $py -m engine.bench gpu-check --out "$out" --json > /dev/null 2> "$out/gpu_check.log"
echo "gpu-check: exit $? (124: cut at 430 s; gpu_check.json holds the sections it finished)"
tail -c 6000 "$out/gpu_check.json"
