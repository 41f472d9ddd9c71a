#!/usr/bin/env bash
# Set up ./.venv and run a job:
#   bash scripts/dev.sh demo [bench options]   the main job: save/load/async figures on a synthetic model
#                                              (in ./bench_out/demo unless --dir DIR is given); installs
#                                              only what it runs: torch (the CPU build, constraints.txt)
#                                              and dcp_nvme[bench]
#   bash scripts/dev.sh test [pytest options]  the test suite; installs the rest too: the dev and s3
#                                              extras, the harness (harness/, never shipped) and the
#                                              trainer libraries of integration/
#   bash scripts/dev.sh test --fast [...]      the fast lane: all but the slow tests, the simulated
#                                              clusters and the integrations (-m "not slow and not
#                                              cluster": harness/dcp_nvme_harness/progress.py);
#                                              CI (.ci/run) runs the whole suite
#   bash scripts/dev.sh test --torch 2.15 [...] the suite's parts that a torch release can break, on
#                                              that release (2.13, 2.14 or 2.15), in .venv-torch2.15
#                                              (made and installed once, pip's cache reused): save,
#                                              load, format, tools, peers, tiers, PyTorch's own DCP
#                                              tests with ours (tests/cross/test_conformance.py), the
#                                              torch names of compat.py, the install that keeps torch,
#                                              one simulated cluster and the integrations; paths given
#                                              after it run instead of that list
# Each part is installed once, and again when the files it comes from change (a stamp each in .venv/):
# `test` after `demo` adds only the rest, `demo` after `test` installs nothing. The installer is uv
# (pip install uv, then uv with pip's own settings: scripts/uv_pip.py), else pip where uv cannot be
# installed; DEV_INSTALLER=pip picks pip.
set -euo pipefail
cd "$(dirname "$0")/.."
job="${1:-}"
[ $# -gt 0 ] && shift
case "$job" in
  demo|test) ;;
  *) echo "usage: bash scripts/dev.sh demo|test [options]" >&2; exit 2 ;;
esac

venv=.venv
torch_pin=torch==2.13.0
# --torch X.Y (test only): the release to run on, in a venv of its own; constraints.txt with its pin
torch_args=() torch_release=""
while [ $# -gt 0 ]; do
  case "$1" in
    --torch) torch_release="${2:-}"; shift 2 || { echo "dev.sh: --torch needs a release: 2.13, 2.14 or 2.15" >&2; exit 2; } ;;
    *) torch_args+=("$1"); shift ;;
  esac
done
set -- ${torch_args[@]+"${torch_args[@]}"}
if [ -n "$torch_release" ]; then
  case "$torch_release" in
    2.13) torch_pin=torch==2.13.0 ;;
    2.14) torch_pin=torch==2.14.1 ;;
    2.15) torch_pin=torch==2.15.0 ;;  # the CUDA build (no CPU wheel of it is published); runs on CPU
    *) echo "dev.sh: --torch $torch_release: the releases tested are 2.13, 2.14 and 2.15" >&2; exit 2 ;;
  esac
  [ "$job" = test ] || { echo "dev.sh: --torch is an option of test" >&2; exit 2; }
  venv=".venv-torch$torch_release"
  mkdir -p "$venv"
  { grep -v '^torch==' constraints.txt; echo "$torch_pin"; } > "$venv/constraints.txt.new"
  cmp -s "$venv/constraints.txt.new" "$venv/constraints.txt" || mv "$venv/constraints.txt.new" "$venv/constraints.txt"
  rm -f "$venv/constraints.txt.new"
  # in place of pip's site constraints, which may cap torch below the release asked for
  export PIP_CONSTRAINT="$PWD/$venv/constraints.txt"
fi
constraints=constraints.txt
[ -z "$torch_release" ] || constraints="$venv/constraints.txt"
py="$venv/bin/python"
[ -x "$py" ] || python3 -m venv "$venv"
rm -f "$venv/.installed"  # the one stamp of before

installer=""
install() {  # install ARGS...: pip install ARGS into .venv, under constraints.txt
  if [ -z "$installer" ]; then
    installer=pip
    if [ "${DEV_INSTALLER:-uv}" != pip ]; then
      if [ -x "$venv/bin/uv" ] || said="$("$py" -m pip install -q -c "$constraints" uv 2>&1)"; then
        installer=uv
      else
        echo "$said" | tail -n 3 >&2
        echo "dev.sh: uv could not be installed (above); installing with pip" >&2
      fi
    fi
    [ "$installer" = uv ] || "$py" -m pip install -q --upgrade pip
  fi
  if [ "$installer" = uv ]; then
    # bytecode compiled now, as pip does: uv leaves none, and where PYTHONDONTWRITEBYTECODE is set
    # every process of the suite compiled botocore, megatron, lightning... again on import
    "$py" scripts/uv_pip.py "$venv/bin/uv" -q --compile-bytecode -c "$constraints" "$@"
  else
    "$py" -m pip install -q -c "$constraints" "$@"
  fi
}
stale() {  # stale PART FILES...: whether PART is not installed as FILES now say (then `installed PART`)
  want="$(cat "${@:2}" | sha256sum | cut -c1-16)"
  [ "$(cat "$venv/.installed-$1" 2>/dev/null)" != "$want" ]
}
installed() { echo "$want" > "$venv/.installed-$1"; }

# the demo's part: torch and dcp_nvme with the bench extra (matplotlib, for --plot)
if stale demo pyproject.toml "$constraints"; then
  install "$torch_pin" -e ".[bench]"
  installed demo
fi
# the test suite's part: the dev and s3 extras; the test harness (simulated nodes, object stores), a
# package of its own, never shipped; the trainer libraries the integration scenarios drive
# (lightning, torchtitan, megatron-core)
if [ "$job" = test ] && stale test pyproject.toml harness/pyproject.toml "$constraints" integration/requirements.txt; then
  install -e ".[dev,s3,bench]" -e ./harness -r integration/requirements.txt
  installed test
fi

case "$job" in
  # a --dir DIR (or --size) given after `demo` overrides these: argparse keeps the last one
  demo) exec "$venv/bin/dcp-nvme" bench --size 512MiB --dir ./bench_out/demo "$@" ;;
  # two workers, one test file each at a time: most tests wait on subprocesses and disks, and a
  # file's module fixtures (servers, saved checkpoints) stay in one worker; the files in the order
  # the harness collects them (the longest first; xdist would put the files of most tests first);
  # -n 0 runs in one process
  test)
    args=() paths=0
    for arg in "$@"; do
      if [ "$arg" = --fast ]; then args+=(-m "not slow and not cluster"); else args+=("$arg"); fi
      case "$arg" in tests*|integration*) paths=1 ;; esac
    done
    if [ -n "$torch_release" ] && [ "$paths" = 0 ]; then
      args+=(tests/save tests/load tests/format tests/tools tests/peers tests/tiers tests/cross/test_conformance.py
             tests/cross/test_compat.py tests/cross/test_install_keeps_torch.py tests/cross/test_node_local.py
             integration)
    fi
    exec "$py" -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25 ${args[@]+"${args[@]}"} ;;
esac
