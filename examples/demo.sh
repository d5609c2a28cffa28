#!/usr/bin/env bash
# The README's first quick-start command (`make demo`): GRPO on the bundled tiny Ouro,
# with no model download and no GPU. Prints held-out accuracy per K before and after,
# and leaves the run (metrics.jsonl, evaluations.jsonl, metrics.png, checkpoint) in runs/demo.
set -euo pipefail
cd "$(dirname "$0")/.."
exec ouro train --depths 2 3 4 --run-dir runs/demo --overwrite --plot "$@"
