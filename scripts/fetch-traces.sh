#!/usr/bin/env bash
# Fetches the job traces perch's replays need from outside this repository, and checks (or,
# with --regenerate, rewrites) the ones it generates itself. Sources and licences:
# scheduler/traces/README.md.
#
#   scripts/fetch-traces.sh                # ../shared/traces/philly.csv, checked by SHA-256
#   scripts/fetch-traces.sh --regenerate   # also rewrites scheduler/traces/*.csv with perch
#
# TRACES_DIR (default ../shared/traces, beside the clone, where `perch simulate --suite` and the
# scheduler's examples look) is where the Philly trace goes; PHILLY_URL replaces its address
# (a mirror, a local file:// copy). PERCH is the perch binary used to regenerate (default: the
# debug build in $CARGO_TARGET_DIR, else `cargo run`).
set -euo pipefail
cd "$(dirname "$0")/.."

traces_dir="${TRACES_DIR:-../shared/traces}"
# Microsoft's Philly job log, flattened to one line per job by the Pollux (OSDI '21) artifact.
philly_url="${PHILLY_URL:-https://raw.githubusercontent.com/petuum/adaptdl/de25dcc90c350b8ade3a710e437a651a8d2efae6/simulator/traces/philly.csv}"
philly_sha256=ebffb3dd1589bdf4e7bcd74496201c5ded1d557d498ee14f560463f37ec353da

regenerate=false
case "${1:-}" in
  "") ;;
  --regenerate) regenerate=true ;;
  *) echo "usage: $0 [--regenerate]" >&2; exit 2 ;;
esac

sha256() { sha256sum "$1" | cut -d' ' -f1; }

# --- the Philly trace ---------------------------------------------------------------------------
philly="$traces_dir/philly.csv"
if [ -f "$philly" ] && [ "$(sha256 "$philly")" = "$philly_sha256" ]; then
  echo "philly.csv: already at $philly (SHA-256 checked)"
else
  mkdir -p "$traces_dir"
  part="$philly.part"
  echo "philly.csv: fetching $philly_url"
  if command -v curl >/dev/null 2>&1; then
    curl --fail --location --silent --show-error --output "$part" "$philly_url"
  elif command -v wget >/dev/null 2>&1; then
    wget --quiet --output-document="$part" "$philly_url"
  else
    echo "philly.csv: neither curl nor wget is installed; install one, or fetch $philly_url to $philly by hand" >&2
    exit 1
  fi
  got="$(sha256 "$part")"
  if [ "$got" != "$philly_sha256" ]; then
    rm -f "$part"
    echo "philly.csv: $philly_url has SHA-256 $got, not $philly_sha256 (the file BENCHMARKS.md's figures come from); set PHILLY_URL to a copy of that file" >&2
    exit 1
  fi
  mv "$part" "$philly"
  echo "philly.csv: $philly (82,247 jobs, SHA-256 checked)"
fi

# The tests' 300-job excerpt is the trace's first 300 jobs.
if ! head -n 301 "$philly" | cmp -s - scheduler/tests/data/philly-300.csv; then
  echo "scheduler/tests/data/philly-300.csv is not the first 300 jobs of $philly (head -n 301)" >&2
  exit 1
fi
echo "philly-300.csv: the first 300 jobs of philly.csv"

# --- the synthetic traces (perch's own generator) -----------------------------------------------
if $regenerate; then
  perch="${PERCH:-}"
  if [ -z "$perch" ]; then
    built="${CARGO_TARGET_DIR:-$HOME/.cache/perch-target}/debug/perch"
    if [ -x "$built" ]; then
      perch="$built"
    else
      cargo build --quiet --locked --bin perch
      perch="$built"
    fi
  fi
  for kind in small fractional gangs heavy-tail testbed overloaded small-nodes bursts mixed-cluster; do
    "$perch" simulate --generate "$kind" --seed 1 >"scheduler/traces/$kind.csv"
    echo "scheduler/traces/$kind.csv: regenerated"
  done
else
  echo "scheduler/traces/*.csv: perch's generator at seed 1 (scheduler/tests/sim.rs checks them; --regenerate rewrites them)"
fi
