# usage: bash bench/zoo_loop.sh COMMIT model1 model2 ...
# bench/zoo.py once per model (one process each) within one device call: a model is started only while
# ~5 minutes of the call's budget remain (ZOO_BUDGET_S, default 590 s: a whole 600 s device call);
# its rows and report go to $OUT.
export PYTHONPATH=. SPEEDKIT_COMMIT=$1; shift
start=$(date +%s); budget=${ZOO_BUDGET_S:-590}
rows=$OUT/$(date +%F)_$(python -c 'from bench.common import gpu_slug; print(gpu_slug())').jsonl  # bench/results' name
for m in "$@"; do
  left=$((budget-($(date +%s)-start)))
  if [ $left -lt 300 ]; then echo "NOT RUN $m (left ${left}s)"; continue; fi
  echo "=== $m"
  timeout $((left-3)) python bench/zoo.py --models $m --time-guard-s 180 --results $rows > $OUT/$m.log 2>&1
  echo "rc $? after $(( $(date +%s)-start ))s"; grep -v -i "warn" $OUT/$m.log | grep "^$m\|kept\|switches:" | tail -8
done
