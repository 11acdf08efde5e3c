// Command chartpin prints the Cilium chart the compatibility table pins, as
// the Dockerfile fetches it: its URL, its digest (sha256:<hex>) and the file
// name the controller loads it by, on one line.
package main

import (
	"fmt"
	"os"

	"maesh.dev/ichor/api/compat"
)

func main() {
	t, err := compat.Default()
	if err != nil {
		fmt.Fprintln(os.Stderr, "chartpin:", err)
		os.Exit(1)
	}
	p := t.CiliumChart
	fmt.Println(p.URL(), p.Digest, p.Archive())
}
