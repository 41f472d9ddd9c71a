#!/usr/bin/env bash
# Set up ./.venv (once; again when pyproject.toml or constraints.txt change) and run a job:
#   bash scripts/dev.sh demo [bench options]   the main job: save/load/async figures on a synthetic model
#                                              (in ./bench_out/demo unless --dir DIR is given)
#   bash scripts/dev.sh test [pytest options]  the test suite
set -euo pipefail
cd "$(dirname "$0")/.."
job="${1:-}"
[ $# -gt 0 ] && shift
case "$job" in
  demo|test) ;;
  *) echo "usage: bash scripts/dev.sh demo|test [options]" >&2; exit 2 ;;
esac

venv=.venv
stamp="$venv/.installed"
want="$(cat pyproject.toml constraints.txt integration/requirements.txt | sha256sum | cut -c1-16)"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -c constraints.txt "torch==2.13.0"
  "$venv/bin/python" -m pip install -q -c constraints.txt -e ".[dev,s3,bench]"
  # the trainer libraries the integration scenarios drive (lightning, torchtitan, megatron-core)
  "$venv/bin/python" -m pip install -q -c constraints.txt -r integration/requirements.txt
  echo "$want" > "$stamp"
fi

case "$job" in
  # a --dir DIR (or --size) given after `demo` overrides these: argparse keeps the last one
  demo) exec "$venv/bin/dcp-nvme" bench --size 512MiB --dir ./bench_out/demo "$@" ;;
  # two workers, one test file each at a time: most tests wait on subprocesses and disks, and a
  # file's module fixtures (servers, saved checkpoints) stay in one worker; -n 0 runs in one process
  test) exec "$venv/bin/python" -m pytest -q -n 2 --dist loadfile --durations=25 "$@" ;;
esac
