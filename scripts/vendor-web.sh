#!/usr/bin/env bash
# Rebuilds server/web/vendor/ (the web view's third-party files, compiled into the perch binary)
# from the npm registry: uPlot, the time-series chart library. Needs npm; nothing else of the
# web view has a build step.
#
#   ./scripts/vendor-web.sh
#
# To move to another version, change UPLOT_VERSION and UPLOT_SHA256 (the npm tarball's
# sha256, `sha256sum` of what `npm pack uplot@VERSION` writes), run this, and commit the files.
set -euo pipefail
cd "$(dirname "$0")/.."
UPLOT_VERSION=1.6.32
UPLOT_SHA256=4b8a8191e425658e3ea8c8c1314b0fc679c861ee3a1af2b20c7b16ba50b5133d

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "uplot@$UPLOT_VERSION" >/dev/null)
tarball="$work/uplot-$UPLOT_VERSION.tgz"
echo "$UPLOT_SHA256  $tarball" | sha256sum --check --quiet
tar -xzf "$tarball" -C "$work"
out=server/web/vendor
mkdir -p "$out"
cp "$work/package/dist/uPlot.iife.min.js" "$work/package/dist/uPlot.min.css" "$out/"
cp "$work/package/LICENSE" "$out/uPlot.LICENSE"
echo "uPlot $UPLOT_VERSION (MIT), from npm; rebuilt by scripts/vendor-web.sh" >"$out/README"
ls -l "$out"
