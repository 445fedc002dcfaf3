#!/usr/bin/env bash
# placement_bench.sh: balanced, heat and heat with replicas against the embedded model's real
# routing at np 7 (bench/placement_bench.cpp): statistics learned on the KJV corpus, measured on
# the held-out text (a workload nothing was tuned on) and, as the in-sample ceiling, on the corpus
# itself; one row a call (decode steps) and 64 (batched prefill).
#   bench/placement_bench.sh
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${BUILD_DIR:-$root/build}
corpus=$root/tests/data/tokenizer/corpus.txt
for measure in "$root/tests/data/embedded/heldout.txt" "$corpus"; do
  for rows in 1 64; do
    "$build/bench/placement_bench" --model "$root/models/glm5-tiny-kjv" --learn "$corpus" \
      --measure "$measure" --learn-tokens 30000 --measure-tokens 1500 --rows "$rows"
  done
done
# A workload that changes halfway: the held-out text, then this project's README (English prose
# the model never saw); heat as placed at start against heat re-placed every 125 tokens.
"$build/bench/placement_bench" --model "$root/models/glm5-tiny-kjv" --learn "$corpus" \
  --measure "$root/tests/data/embedded/heldout.txt" --shift "$root/README.md" \
  --learn-tokens 30000 --measure-tokens 1500 --rows 16 --window 250 --repin-every 125
