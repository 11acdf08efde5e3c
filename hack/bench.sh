#!/usr/bin/env bash
# Runs every benchmark of the module, each in a process of its own: a
# benchmark that starts a test world (kube-apiserver, etcd, the controllers)
# then starts it fresh, as a cluster under the measured load alone would be,
# instead of inheriting what the benchmarks before it left in the same API
# server (on 6 December it had grown to 2.2 GB by the reactions, which took
# up to twice as long as on a fresh one). One at a time: two side by side
# would each measure the other's load. Each package's test binary is built
# once. make bench pipes the output through hack/bench-summary.sh.
set -uo pipefail

bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
failed=0
# The packages that have benchmarks, in the order go list gives. Their
# names come from the source: -test.list would run TestMain, which starts
# the test world.
while read -r pkg dir; do
	benches=$(sed -n 's/^func \(Benchmark[A-Za-z0-9_]*\)(.*/\1/p' "$dir"/*_test.go 2>/dev/null)
	[ -n "$benches" ] || continue
	test="$bin/$(echo "$pkg" | tr / _).test"
	if ! go test -c -o "$test" "$pkg"; then
		failed=1
		continue
	fi
	for bench in $benches; do
		echo "# $pkg $bench"
		# go test runs a package's tests in its directory; so does this.
		if ! (cd "$dir" && "$test" -test.run '^$' -test.bench "^$bench\$" -test.benchtime 1x -test.timeout 60m); then
			failed=1
		fi
	done
done < <(go list -f '{{.ImportPath}} {{.Dir}}' ./...)
exit "$failed"
