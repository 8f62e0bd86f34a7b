#!/usr/bin/env bash
# Installs what perch's tests need and runs them all: formatting, lints, the dependency
# direction between crates, and every unit, integration and end-to-end test.
#
#   ./scripts/test.sh
#
# Builds go to $CARGO_TARGET_DIR (default ~/.cache/perch-target, outside the clone, so a fresh
# clone reuses earlier builds).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/perch-target}"

# --- what the tests need beyond cargo -------------------------------------------------------
# promtool (Debian's prometheus package) checks our /metrics and Prometheus config.
missing=()
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v curl >/dev/null 2>&1 || missing+=(curl)
# ip (iproute2) builds the network namespaces and veth pair the NIC test sends real traffic over.
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
# psql (Debian's postgresql-client) is the real client the PostgreSQL-protocol test connects with.
command -v psql >/dev/null 2>&1 || missing+=(postgresql-client)
# Debian's PostgreSQL server: the job store on PostgreSQL and the standby control plane
# (control/tests/job_store.rs, tests/ha.rs) start clusters of their own with its binaries.
compgen -G '/usr/lib/postgresql/*/bin/postgres' >/dev/null || missing+=(postgresql)
# pip installs the Python OpenTelemetry SDK below.
python3 -m pip --version >/dev/null 2>&1 || missing+=(python3-pip)
# The isolation tests (tests/isolation.rs, launcher::isolation_tests) create a user, switch to it
# with setpriv, and build a small preload library with cc.
command -v useradd >/dev/null 2>&1 || missing+=(passwd)
command -v setpriv >/dev/null 2>&1 || missing+=(util-linux)
command -v cc >/dev/null 2>&1 || missing+=(gcc)
# Debian's torch: tests/distributed.rs runs a real torch.distributed all-reduce over gloo on CPU
# across two agents in two network namespaces.
/usr/bin/python3 -c "import torch" >/dev/null 2>&1 || missing+=(python3-torch)
# Debian's Chromium and its WebDriver: tests/web.rs drives the web view in a headless browser.
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
# Debian's Java runtime: Apache Spark (pyspark, below) runs on it in local mode for tests/spark.rs.
command -v java >/dev/null 2>&1 || missing+=(default-jre-headless)
if ((${#missing[@]})); then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  echo "installing: ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# The Python OpenTelemetry SDK: the OTLP test runs a job (`python3` from PATH) that exports its
# metrics with it. psycopg: the PostgreSQL-protocol test's extended-protocol client. moto[server]:
# the S3-compatible server the store's object-storage test runs against.
# PIP_BREAK_SYSTEM_PACKAGES lets pip install into a Debian-managed python3.
if ! python3 -c "import opentelemetry.sdk, opentelemetry.exporter.otlp.proto.http, psycopg, moto.server, flask" 2>/dev/null; then
  PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --quiet opentelemetry-sdk opentelemetry-exporter-otlp-proto-http "psycopg[binary]" "moto[server]"
fi
python3 -c "import aiosmtpd" 2>/dev/null || PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --quiet aiosmtpd # the SMTP server alerts/tests/smtp.rs mails
# DuckDB recomputes job accounting from the raw Parquet files (tests/accounting.rs; that test
# fails, never skips, without it).
python3 -c "import duckdb" 2>/dev/null || PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --quiet duckdb
# Apache Spark (pyspark, local mode on the Java runtime above) recomputes accounting from the
# store's and the settled rows' files (tests/spark.rs runs the recipe of docs/spark.md,
# tests/accounting_spark.py; that test fails, never skips, without it).
python3 -c "import pyspark" 2>/dev/null || PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --quiet "pyspark>=3.5"

# --- a build cache shared with clones at other paths -------------------------------------------
# Cargo names a workspace crate's artifacts and records its sources independently of where the
# clone is, so a test binary built in another clone of this repository (CI's, say) counts as
# fresh here while it carries that clone's paths (env!("CARGO_MANIFEST_DIR") for fixtures).
# When the cache was last used from another path, touch our sources so cargo rebuilds them.
stamp="$CARGO_TARGET_DIR/.perch-clone-path"
if [ "$(cat "$stamp" 2>/dev/null)" != "$PWD" ]; then
  find . -path ./target -prune -o \( -name '*.rs' -o -name Cargo.toml \) -print0 | xargs -0 -r touch
  mkdir -p "$CARGO_TARGET_DIR" && echo "$PWD" >"$stamp"
fi

# --- hygiene ----------------------------------------------------------------------------------
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings

# --- dependencies point downward only ----------------------------------------------------------
# Each workspace crate depends on exactly the workspace crates ARCHITECTURE.md ("Invariants")
# allows it, and on none of the heavy outside crates its layer must not pull in.
ours() { # the workspace crates $1 depends on directly (normal dependencies)
  cargo tree --locked -p "$1" -e normal --depth 1 --prefix none 2>/dev/null | tail -n +2 |
    awk '{print $1}' | grep -E '^(perch|nvml-standin)' | sort -u
}
allow() { # crate, the workspace crates it may depend on
  for dep in $(ours "$1"); do
    case " $2 " in
      *" $dep "*) ;;
      *) echo "dependency rule broken: $1 must not depend on $dep (it may: ${2:-none}; see ARCHITECTURE.md)" >&2
         exit 1 ;;
    esac
  done
}
forbid() { # crate, outside dependency it must not have (directly or through others)
  if cargo tree --locked -p "$1" -e normal --prefix none 2>/dev/null | grep -q "^$2 v"; then
    echo "dependency rule broken: $1 must not depend on $2 (see ARCHITECTURE.md)" >&2
    exit 1
  fi
}
allow perch-model ""
allow nvml-standin ""
allow perch-scheduler ""
allow perch-alerts "perch-model"
allow perch-planner ""
allow perch-query "perch-model perch-planner"
allow perch-collector "perch-model"
allow perch-control "perch-model perch-scheduler"
allow perch-pgwire "perch-model perch-query"
allow perch-server "perch-model perch-query perch-scheduler perch-control perch-alerts perch-pgwire"
# The benchmarks are their own binary (perch bench runs it), never built into perch.
allow perch "perch-model perch-collector perch-query perch-scheduler perch-control perch-alerts perch-server"
allow perch-bench "perch-model perch-collector perch-query perch-control perch-server"
for crate in $(cargo metadata --locked --no-deps --format-version 1 |
                 grep -o '"name":"[a-z-]*","version"' | cut -d'"' -f4); do
  case " perch-model nvml-standin perch-scheduler perch-control perch-alerts perch-planner perch-query perch-collector perch-pgwire perch-server perch perch-bench " in
    *" $crate "*) ;;
    *) echo "dependency rules: $crate has none; add an allow line in scripts/test.sh" >&2; exit 1 ;;
  esac
done
forbid perch-model tokio
forbid perch-scheduler tokio
# The control plane knows nothing of HTTP or SQL: the server maps its errors and serves it.
forbid perch-control axum
forbid perch-control hyper
forbid perch-control datafusion
forbid perch-control arrow
forbid perch-scheduler datafusion
forbid perch-alerts datafusion
forbid perch-collector datafusion
forbid perch-query axum
# One TLS provider (ring): the release binaries build no aws-lc (perch_model::tls).
forbid perch aws-lc-rs
forbid perch-bench aws-lc-rs

# --- tests --------------------------------------------------------------------------------------
# bench/tests/smoke.rs runs every `perch bench` in a tiny mode; the scheduler's divan benchmarks
# run once each below, so no benchmark can stop working unseen.
cargo test --workspace --locked
cargo test -p perch-scheduler --locked --bench pass
