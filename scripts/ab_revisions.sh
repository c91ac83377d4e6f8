#!/usr/bin/env bash
# A/B a bench between a base revision and this checkout, in one run, rounds alternating
# (this machine's memory rate drifts by 2x over minutes: only alternating rounds compare).
#   scripts/ab_revisions.sh REV ROUNDS OUTDIR -- shoal bench offline --peers none
# The base runs from a git worktree laid out as the `shoal` package (symlinks) first on
# PYTHONPATH; this checkout runs as installed. Each run's stdout goes to OUTDIR/{base,head}_N.log
# and, where the bench takes --output, its JSON to OUTDIR/{base,head}_N.json.
set -euo pipefail
rev=$1 rounds=$2 out=$3
shift 3
[ "${1:-}" = "--" ] && shift
[ "${1:-}" = "shoal" ] && shift
root=$(cd "$(dirname "$0")/.." && pwd)
py=$root/.venv/bin/python
tmp=$(mktemp -d)
trap 'git -C "$root" worktree remove --force "$tmp/tree" >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
git -C "$root" worktree add --detach "$tmp/tree" "$rev" >/dev/null
mkdir -p "$tmp/pkg/shoal" "$out"
touch "$tmp/pkg/shoal/__init__.py"
for d in workers router cluster proto benchmarks; do ln -s "$tmp/tree/$d" "$tmp/pkg/shoal/$d"; done
cd "$tmp"  # neither tree's folders on the path by accident
for ((r = 1; r <= rounds; r++)); do
  for side in base head; do
    pp=""
    [ "$side" = base ] && pp=$tmp/pkg
    PYTHONPATH=$pp "$py" -m shoal.cluster.cli "$@" --output "$out/${side}_$r.json" >"$out/${side}_$r.log" 2>&1
    echo "$side $r: $(grep -E '^shoal:|time per output token' "$out/${side}_$r.log" | head -1 | sed 's/^ *//')"
  done
done
