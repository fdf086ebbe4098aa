#!/usr/bin/env bash
# Interleaved A/B of bench/throughput.py (or any bench script): the code at OLD_REV and the
# working tree alternate, PAIRS times, against the same machine, so that a host whose speed
# drifts (15 to 25 % within minutes, seen in issue 13's sessions) moves both sides alike.
# The order turns every pair (old new, new old, ...): an even PAIRS count puts each side
# first as often as second.
#
#   bench/interleaved.sh OLD_REV [PAIRS] [-- BENCH_SCRIPT ARGS...]
#   bench/interleaved.sh 327ba06 3 -- bench/throughput.py --scenario 1 3 4 5 --runs 1 --commands
#
# The old code runs from a git worktree (made once, under .bench-worktrees/), with the bench
# started from that directory and PYTHONPATH set to it: a worker's `python -m celery` puts its
# working directory ahead of PYTHONPATH, so the working tree's package would otherwise win.
# Uses this checkout's .venv (make test builds it); DATABASE_URL / REDIS_URL as the script does.
set -euo pipefail
cd "$(dirname "$0")/.."
old=${1:?usage: bench/interleaved.sh OLD_REV [PAIRS] [-- BENCH_SCRIPT ARGS...]}
shift
pairs=3
if [ $# -gt 0 ] && [ "$1" != "--" ]; then pairs=$1; shift; fi
[ "${1:-}" = "--" ] && shift
[ $# -gt 0 ] || set -- bench/throughput.py --scenario 1 3 4 5 --runs 1 --commands
here=$(pwd)
rev=$(git rev-parse --short "$old")
tree="$here/.bench-worktrees/$rev"
[ -d "$tree" ] || git worktree add --detach -q "$tree" "$rev"
# the old side's embedded servers live in its worktree: stopped at the end, whatever happens
trap '(cd "$tree" && PYTHONPATH="$tree" "$here/.venv/bin/python" -m payment_worker.cli services stop >/dev/null 2>&1) || true' EXIT
for i in $(seq 1 "$pairs"); do
  # the order turns every pair (old new, new old, old new, ...): two pairs in a row are an
  # ABBA block, which a steady drift moves alike on both sides (a fixed order does not)
  sides="old new"
  [ $((i % 2)) -eq 0 ] && sides="new old"
  for side in $sides; do
    dir=$here
    [ "$side" = old ] && dir=$tree
    echo "== pair $i $side ($( [ "$side" = old ] && echo "$rev" || echo "working tree" ))"
    (cd "$dir" && PYTHONPATH="$dir" "$here/.venv/bin/python" "$@" 2>&1 | grep -v '^{')
  done
done
