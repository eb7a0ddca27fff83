#!/usr/bin/env bash
# One device call after `bash .gpu/b/device-setup.sh b` (bench/gpu_stage_fit.py): `make bench-gpu`'s parts in the order
# ORDER names ("part=max_s,..."), under DEADLINE seconds; results and the demo's small files in $OUT.
set -u; cd /root/proj; mkdir -p "$OUT"
export PYTHONWARNINGS=ignore TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python3 - "${ORDER}" <<'PY'
import json, sys; sys.path.insert(0, "bench")
from bench_gpu_all import default_plan
plan = {p["name"]: p for p in default_plan()}
out = []
for item in sys.argv[1].split(","):
    name, max_s = item.split("=")
    p = plan[name]; p["max_s"] = int(max_s)
    if name.startswith("step:"):
        p["argv"] += ["--profile", "3"]
    out.append(p)
json.dump(out, open("/tmp/plan.json", "w"))
print("plan:", [(p["name"], p["max_s"]) for p in out])
PY
timeout -k 5 "$((DEADLINE + 10))" python3 bench/bench_gpu_all.py --deadline "$DEADLINE" --plan /tmp/plan.json \
  --json "$OUT/parts.jsonl" --markdown "$OUT/table.md" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
if [ -d runs/demo-gpu ]; then
  find runs/demo-gpu -maxdepth 3 -type f \( -name '*.json' -o -name '*.jsonl' -o -name '*.md' -o -name '*.txt' -o -name '*.log' -o -name '*.yaml' \) -size -4M \
    | tar -czf "$OUT/demo-gpu.tgz" -T - 2>/dev/null
fi
tail -30 "$OUT/bench.log"
