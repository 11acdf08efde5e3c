// Command kubectl-ichor is the kubectl plugin for Ichor: it creates
// TalosOperations, prints them, watches them live, and pauses, resumes and
// retries them. Installed as `ichor` it works the same and calls itself that.
package main

import (
	"os"

	"k8s.io/cli-runtime/pkg/genericiooptions"
	_ "k8s.io/client-go/plugin/pkg/client/auth" // exec and OIDC auth providers in kubeconfigs

	"maesh.dev/ichor/plugin/commands"
)

func main() {
	streams := genericiooptions.IOStreams{In: os.Stdin, Out: os.Stdout, ErrOut: os.Stderr}
	os.Exit(commands.Execute(os.Args, streams))
}
