#!/usr/bin/env bash
# `make release`: what a user installs, checked the way a user gets it.
#   1. the sdist and the wheel, built by `python -m build` into .release/dist (the wheel is
#      built from the sdist, so a file the sdist lacks is missing from the wheel too);
#   2. a fresh venv, .release/venv: torch and numpy pinned by .ci/constraints.txt (the CPU
#      build on local disk: an open range would pull a multi-GB CUDA build), then the built
#      wheel file itself (not the source tree, not editable);
#   3. tests/release, run by the project's .venv against that venv (RELEASE_VENV, RELEASE_DIST):
#      the wheel's and the sdist's contents, `guardrails demo` and `guardrails check` on the
#      shipped profiles from outside the repository, the engines' plugin entry points.
# Everything under .release/ is made afresh on each run.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=.release
dist=$out/dist
venv=$out/venv
py=.venv/bin/python
test -x "$py" || { echo "no $py: run \`make install\` first" >&2; exit 2; }

started=$SECONDS
step() {
    local name=$1 t0=$SECONDS
    shift
    echo "==> [release] $name"
    "$@"
    echo "==> [release] $name: $((SECONDS - t0)) s"
}

build_dist() {
    "$py" -c 'import build' 2>/dev/null || "$py" -m pip install -q build
    rm -rf "$dist"
    "$py" -m build --outdir "$dist" . >"$out/build.log" 2>&1 \
        || { cat "$out/build.log" >&2; return 1; }
    ls -l "$dist"
}

fresh_venv() {
    rm -rf "$venv"
    "${PYTHON:-python3}" -m venv "$venv"
    "$venv/bin/python" -m pip --disable-pip-version-check -q install \
        -c .ci/constraints.txt torch numpy
}

install_wheel() {
    local wheels=("$dist"/*.whl)
    [ ${#wheels[@]} -eq 1 ] || { echo "expected one wheel in $dist: ${wheels[*]}" >&2; return 1; }
    "$venv/bin/python" -m pip --disable-pip-version-check -q install \
        -c .ci/constraints.txt "${wheels[0]}"
}

run_tests() {
    RELEASE_VENV=$venv RELEASE_DIST=$dist "$py" -m pytest -p no:cacheprovider tests/release
}

mkdir -p "$out"
step "sdist and wheel (python -m build)" build_dist
step "fresh venv with torch and numpy (.ci/constraints.txt)" fresh_venv
step "the wheel into the fresh venv" install_wheel
step "tests/release against $venv" run_tests
echo "==> [release] ok in $((SECONDS - started)) s"
