// Command clusterrole-aggregator runs kube-controller-manager's ClusterRole
// aggregation controller, and nothing else, against an API server. envtest
// starts no controller manager, so without it the built-in admin, edit and
// view roles never take in the rules of the roles labelled to aggregate into
// them; the integration tests of Ichor's RBAC (manifests/) run it beside
// kube-apiserver. It is the upstream controller, built from k8s.io/kubernetes
// at the apiserver's version.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/kubernetes/pkg/controller/clusterroleaggregation"
)

func main() {
	kubeconfig := flag.String("kubeconfig", "", "kubeconfig of the API server")
	flag.Parse()
	if err := run(*kubeconfig); err != nil {
		fmt.Fprintln(os.Stderr, "clusterrole-aggregator:", err)
		os.Exit(1)
	}
}

func run(kubeconfig string) error {
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return fmt.Errorf("load %s: %w", kubeconfig, err)
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	factory := informers.NewSharedInformerFactory(cs, 0)
	c := clusterroleaggregation.NewClusterRoleAggregation(factory.Rbac().V1().ClusterRoles(), cs.RbacV1())
	factory.Start(ctx.Done())
	c.Run(ctx, 1)
	return nil
}
