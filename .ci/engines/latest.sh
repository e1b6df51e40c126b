#!/usr/bin/env bash
# `make engines-latest`: the canary for the next engine release (not part of CI: it asks the
# package index for the newest versions). For the newest vLLM, SGLang and transformers it builds
# a venv the way `make engines` does (.engines/latest-ENGINE-VERSION, from the newest pinned list
# with the engine's own line replaced), runs `guardrails check --strict` on the engine's shipped
# profiles and the class-level suites, and prints one table: engine, version, check, suite.
#
# check: "ok"; "newer only" when the one error is that the version is newer than the profile's
# `verified_with` (expected for a release nobody has verified yet: everything the hooks read was
# found); else "FAILED (N errors)", the first ones printed above the table.
#   bash .ci/engines/latest.sh [ENGINE ...]      (default: vllm sglang transformers)
#   LATEST_VLLM=0.35.0 bash .ci/engines/latest.sh vllm   (a version instead of the newest)
set -uo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .engines/latest
results=.engines/latest/results
rm -rf "$results" && mkdir -p "$results"
table=.engines/latest/table.md
printf '| engine | version | check --strict | suite |\n|---|---|---|---|\n' >"$table"

newest() {  # the newest version of a distribution on the index pip is configured with
    python3 -m pip --disable-pip-version-check index versions "$1" 2>/dev/null |
        sed -n "s/^$1 (\(.*\))$/\1/p" | head -n1
}

# A venv for ENGINE at VERSION; echoes its path. vLLM and SGLang: the newest pinned list of
# .ci/engines/ (--no-deps, as build.sh does) with the engine's line replaced. transformers:
# guardrails with its dev extra and that transformers with its serving extra (the serve
# profile's parts import it), resolved by pip against the pinned torch.
build() {
    local engine=$1 version=$2 venv=.engines/latest-$1-$2
    case "$engine" in
        vllm | sglang)
            local base req=.engines/latest/$engine-$version.txt
            base=$(ls .ci/engines/"$engine"-*.txt | sort -V | tail -n1)
            # Rewritten only when it changes: build.sh rebuilds a venv older than its list.
            sed "s/^$engine==.*/$engine==$version/" "$base" >"$req.new"
            if cmp -s "$req.new" "$req"; then rm "$req.new"; else mv "$req.new" "$req"; fi
            bash .ci/engines/build.sh "$engine-$version" "$req" "$venv" >&2 || return 1
            ;;
        transformers)
            if [ ! -f "$venv/.installed-stamp" ]; then
                rm -rf "$venv"
                "${PYTHON:-python3}" -m venv "$venv" &&
                    "$venv/bin/python" -m pip --disable-pip-version-check -q install \
                        -c .ci/constraints.txt torch numpy >&2 &&
                    "$venv/bin/python" -m pip --disable-pip-version-check -q install \
                        -c .ci/constraints.txt -e ".[dev]" "transformers[serving]==$version" >&2 &&
                    touch "$venv/.installed-stamp" || return 1
            fi
            ;;
    esac
    echo "$venv"
}

check() {  # venv profile...: "ok", "newer only" or "FAILED (N errors)"
    local venv=$1 errors=0 newer=0 out
    shift
    for profile in "$@"; do
        # SGLang imports torchvision, whose PyPI wheel needs a CUDA torch: the suites' labelled
        # import stand-in (tests/engines/stubs/torchvision), as `make engines` uses it.
        out=$(PYTHONPATH=tests/engines/stubs "$venv/bin/guardrails" check --strict \
            --config "config/profiles/$profile" 2>&1)
        local found
        found=$(grep -c '^guardrails check: error:' <<<"$out")
        errors=$((errors + found))
        newer=$((newer + $(grep '^guardrails check: error:' <<<"$out" | grep -c 'newer than')))
        if [ "$found" -gt 0 ]; then
            grep '^guardrails check: error:' <<<"$out" | grep -v 'newer than' | head -n 5 >&2
        fi
    done
    if [ "$errors" -eq 0 ]; then
        echo ok
    elif [ "$errors" -eq "$newer" ]; then
        echo "newer only"
    else
        echo "FAILED ($((errors - newer)) errors)"
    fi
}

suite() {  # engine venv version: "N passed, M failed[, K skipped]" from pytest's junit report
    local engine=$1 venv=$2 version=$3 xml=$results/$1.xml paths
    case "$engine" in
        vllm) paths=(tests/engines/vllm/v2) ;;  # 0.34.0 on: Model Runner V2 only
        sglang) paths=(tests/engines/sglang) ;;
        transformers) paths=(tests/attach/test_transformers.py tests/attach/test_transformers_hooks.py) ;;
    esac
    ENGINE_SUITE="$engine-$version" ENGINE_RESULTS="$results/$engine.jsonl" \
        "$venv/bin/python" -m pytest -p no:cacheprovider -q --junitxml="$xml" "${paths[@]}" >&2
    python3 - "$xml" <<'EOF'
import sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    print("no report"); sys.exit()
suites = [root] if root.tag == "testsuite" else list(root)
n = lambda key: sum(int(s.get(key, 0)) for s in suites)
failed = n("failures") + n("errors")
passed = n("tests") - failed - n("skipped")
print(f"{passed} passed, {failed} failed" + (f", {n('skipped')} skipped" if n("skipped") else ""))
EOF
}

engines=("$@")
[ ${#engines[@]} -gt 0 ] || engines=(vllm sglang transformers)
for engine in "${engines[@]}"; do
    override=LATEST_${engine^^}
    version=${!override:-$(newest "$engine")}
    if [ -z "$version" ]; then
        echo "| $engine | (index not reachable) | - | - |" >>"$table"
        continue
    fi
    echo "==> [latest] $engine $version"
    if ! venv=$(build "$engine" "$version"); then
        echo "| $engine | $version | - | venv build failed |" >>"$table"
        continue
    fi
    case "$engine" in
        vllm) profiles=(vllm.toml) ;;
        sglang) profiles=(sglang.toml) ;;
        transformers) profiles=(transformers.toml transformers-serve.toml) ;;
    esac
    verdict=$(check "$venv" "${profiles[@]}")
    outcome=$(suite "$engine" "$venv" "$version")
    echo "| $engine | $version | $verdict | $outcome |" >>"$table"
done
echo
cat "$table"
