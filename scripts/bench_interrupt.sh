#!/bin/bash
# Ctrl-C during a long forward: one eval of the embedded model at LENGTH tokens (default 32k), SIGINT DELAY seconds
# (default 20) after its plan line (inside the first forward), and the seconds from the signal to the process's exit.
# Usage: scripts/bench_interrupt.sh [LENGTH] [DELAY]   (results: a line on stdout; the run's stderr in $WORK/err.txt)
set -u
LENGTH=${1:-32k}
DELAY=${2:-20}
WORK=$(mktemp -d)
start=$(date +%s.%N)
python -m rope_patch eval --lengths "$LENGTH" --documents 1 --method none --output "$WORK/out" >"$WORK/out.txt" 2>"$WORK/err.txt" &
pid=$!
while ! grep -q "plan:" "$WORK/err.txt" 2>/dev/null; do
    sleep 1
    kill -0 $pid 2>/dev/null || { echo "the eval ended before its plan: see $WORK/err.txt"; exit 1; }
done
planned=$(date +%s.%N)
sleep "$DELAY"
sent=$(date +%s.%N)
kill -INT $pid
wait $pid
code=$?
ended=$(date +%s.%N)
echo "length=$LENGTH plan_after_s=$(echo "$planned - $start" | bc) sigint_after_plan_s=$DELAY exit_code=$code" \
     "signal_to_exit_s=$(echo "$ended - $sent" | bc) load: $(cut -d' ' -f1-3 /proc/loadavg)"
