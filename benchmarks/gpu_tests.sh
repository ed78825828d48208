#!/usr/bin/env bash
# The whole GPU test suite in one pytest run on a lent GPU machine (the `run` device tool), from
# the repository root; its outcome lands in $OUT/gpu_tests/ (latest.md, history.jsonl: copy
# them over benchmarks/results/gpu_tests/ and commit) and $OUT/pytest.log.
# Usage: ENGRAM_COMMIT=<sha> bash benchmarks/gpu_tests.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
RESULTS=$(results_copy gpu_tests)
t0=$SECONDS
timeout ${PYTEST_TIMEOUT_S:-540} python3 -m pytest tests/gpu -q -p no:cacheprovider -rfE \
    > "$OUT/pytest.log" 2>&1
rc=$?
seconds=$((SECONDS - t0))
summary=$(grep -E "^(=+ )?[0-9]+ (passed|failed)" "$OUT/pytest.log" | tail -1 | tr -d '=' | xargs)
failed=$(grep -E "^FAILED" "$OUT/pytest.log" | cut -c1-300)
device=$(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs)
RC=$rc SECONDS_TOOK=$seconds SUMMARY="$summary" FAILED="$failed" DEVICE="$device" \
    RESULTS="$RESULTS" python3 - <<'PY'
import json, os, time
r = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "commit": os.environ.get("ENGRAM_COMMIT", "unknown"),
     "device": os.environ["DEVICE"], "command": "bash benchmarks/gpu_tests.sh (pytest tests/gpu)",
     "rc": int(os.environ["RC"]), "seconds": int(os.environ["SECONDS_TOOK"]),
     "summary": os.environ["SUMMARY"], "failed": [l for l in os.environ["FAILED"].splitlines() if l]}
with open(os.path.join(os.environ["RESULTS"], "history.jsonl"), "a") as f:
    f.write(json.dumps(r) + "\n")
lines = [f"# The GPU test suite in one run ({r['date']}, commit {r['commit']})", "",
         f"Device: {r['device']}. Command: `{r['command']}`; pytest exit code {r['rc']}, "
         f"{r['seconds']} s.", "", f"Outcome: {r['summary']}.", ""]
lines += ["Failed:", ""] + [f"- `{l}`" for l in r["failed"]] if r["failed"] else ["No test failed."]
with open(os.path.join(os.environ["RESULTS"], "latest.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
