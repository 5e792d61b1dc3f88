# usage: bash bench/zoo_loop.sh COMMIT model1 model2 ...
# bench/zoo.py once per model (one process each) within one device call (ZOO_BUDGET_S, default 590 s: a
# whole 600 s device call): a model is started only while the call has the time it took last on the
# H200 (a process's whole wall time, trials and fits: at 023fc1f where it ran there, else at
# 8557b78..fce2021), 300 s for a model not listed; one that does not fit is skipped and the next is tried.
# Its rows and report go to $OUT.
export PYTHONPATH=. SPEEDKIT_COMMIT=$1; shift
declare -A expected=([lstm-lm]=80 [lightning-transformer]=130 [timm-vit]=170 [timm-convnext]=240 [hf-bert-mlm]=310
                     [hf-gpt2]=340 [hf-llama]=370 [nanogpt]=300 [tv-resnet50]=370 [hf-t5]=430 [timm-mobilenetv3]=450
                     [hf-bert-cls]=500)
start=$(date +%s); budget=${ZOO_BUDGET_S:-590}
rows=$OUT/$(date +%F)_$(python -c 'from bench.common import gpu_slug; print(gpu_slug())').jsonl  # bench/results' name
for m in "$@"; do
  left=$((budget-($(date +%s)-start))); need=${expected[$m]:-300}
  if [ $left -lt $need ]; then echo "NOT RUN $m (left ${left}s, it takes about ${need}s)"; continue; fi
  echo "=== $m"
  timeout $((left-3)) python bench/zoo.py --models $m --time-guard-s 180 --results $rows > $OUT/$m.log 2>&1
  echo "rc $? after $(( $(date +%s)-start ))s"; grep -v -i "warn" $OUT/$m.log | grep "^$m\|kept\|switches:" | tail -8
done
