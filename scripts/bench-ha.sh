#!/usr/bin/env bash
# Measures the standby control plane (docs/ha.md) on this machine, in one run:
#   1. takeover: two `perch server`s with [ha] on a shared directory and a PostgreSQL of the
#      script's own; the leader is killed with SIGKILL KILLS times (default 20), each time
#      timed from the kill until the other answers /readyz 200, and started again as standby;
#   2. job submission and ingest throughput with the job store on that PostgreSQL against the
#      embedded redb (perch bench jobs --postgres, perch bench ingest [--postgres]).
#
#   cargo build --release && scripts/bench-ha.sh [KILLS]
#
# PERCH names the binary (default $CARGO_TARGET_DIR/release/perch). Needs Debian's postgresql
# package (scripts/test.sh installs it). Results go in BENCHMARKS.md ("Standby control plane").
set -euo pipefail
kills=${1:-20}
perch=${PERCH:-${CARGO_TARGET_DIR:-$HOME/.cache/perch-target}/release/perch}
[ -x "$perch" ] || { echo "no perch binary at $perch: cargo build --release, or set PERCH" >&2; exit 1; }
pgbin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
[ -n "$pgbin" ] || { echo "no PostgreSQL server: install Debian's postgresql package" >&2; exit 1; }
work=$(mktemp -d /tmp/perch-ha-bench.XXXXXX)
chmod 777 "$work"
as_pg() { if [ "$(id -u)" = 0 ]; then setpriv --reuid=postgres --regid=postgres --clear-groups -- "$@"; else "$@"; fi; }
cleanup() {
  for f in "$work"/*.pid; do [ -e "$f" ] && kill -9 "$(cat "$f")" 2>/dev/null || true; done
  as_pg "$pgbin/pg_ctl" -D "$work/pg" -m fast stop >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
as_pg "$pgbin/initdb" -A trust -U postgres -D "$work/pg" --no-sync >/dev/null
as_pg "$pgbin/pg_ctl" -D "$work/pg" -l "$work/pg.log" -o "-k $work -c listen_addresses=" -w start >/dev/null
db="host=$work user=postgres dbname=postgres"

for n in a b; do
  cat >"$work/$n.toml" <<TOML
[server]
listen = "127.0.0.1:0"
data_dir = "$work/shared"
pg_listen = ""
[ha]
database = "$db"
name = "$n"
TOML
done

ready() { curl -sf -m 2 "$1/readyz" >/dev/null 2>&1; }
url_of() { echo "http://$(cat "$work/shared/ha/$1.addr")"; }
start() { # name: starts it and waits until it answers /healthz
  rm -f "$work/shared/ha/$1.addr"
  "$perch" server --config "$work/$1.toml" >>"$work/$1.log" 2>&1 &
  echo $! >"$work/$1.pid"
  disown
  until [ -s "$work/shared/ha/$1.addr" ] && curl -sf -m 2 "$(url_of "$1")/healthz" >/dev/null 2>&1; do sleep 0.05; done
}
now() { date +%s.%N; }

start a
until ready "$(url_of a)"; do sleep 0.05; done
start b
times=()
for i in $(seq "$kills"); do
  if ready "$(url_of a)"; then leader=a other=b; else leader=b other=a; fi
  kill -9 "$(cat "$work/$leader.pid")"
  t0=$(now)
  until ready "$(url_of $other)"; do sleep 0.05; done
  t1=$(now)
  times+=("$(echo "$t1 - $t0" | bc)")
  printf 'kill %2d: %s killed, %s led after %.2f s\n' "$i" "$leader" "$other" "${times[-1]}"
  start "$leader"
done
sorted=$(printf '%s\n' "${times[@]}" | sort -n)
median=$(echo "$sorted" | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}')
slowest=$(echo "$sorted" | tail -1)
printf 'takeover after SIGKILL of the leader (%d kills, lease_secs 10): median %.2f s, slowest %.2f s\n' "$kills" "$median" "$slowest"
for f in "$work"/a.pid "$work"/b.pid; do kill -9 "$(cat "$f")" 2>/dev/null || true; rm -f "$f"; done

# The servers are gone; the lease row may still name one: a fresh database for the benches.
as_pg "$pgbin/createdb" -h "$work" -U postgres bench
"$perch" bench jobs --seconds 5 --starts 1 --dir "$work" --postgres "host=$work user=postgres dbname=bench"
"$perch" bench ingest --seconds 10 --dir "$work"
as_pg "$pgbin/createdb" -h "$work" -U postgres bench_ingest
"$perch" bench ingest --seconds 10 --dir "$work" --postgres "host=$work user=postgres dbname=bench_ingest"
