#!/usr/bin/env bash
# Passes `go test -bench` output through and ends it with a table of every
# figure: those reported against their budget (a metric named */budget) as
# the ratio, within the budget at 1 or less, and the others (no budget,
# like lists or MiB) as reported. make bench pipes its run through it; each
# line goes on as it comes, so a long run shows where it is.
set -euo pipefail
awk '
{ print; fflush() }
$1 ~ /^Benchmark/ && NF >= 4 {
  for (i = 3; i < NF; i += 2) {
    unit = $(i + 1)
    if (unit == "ns/op") continue
    n++; name[n] = $1; metric[n] = unit; value[n] = $i
  }
}
END {
  if (n == 0) exit
  print ""
  printf "%-52s %-36s %10s  %s\n", "benchmark", "figure", "value", "against its budget"
  for (j = 1; j <= n; j++) {
    verdict = "reported (no budget)"
    if (metric[j] ~ /\/budget$/) verdict = (value[j] + 0 <= 1) ? "within" : "OVER"
    if (metric[j] == "lists") verdict = (value[j] + 0 == 0) ? "within (budget 0)" : "OVER (budget 0)"
    printf "%-52s %-36s %10s  %s\n", name[j], metric[j], value[j], verdict
  }
}'
