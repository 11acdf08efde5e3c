package app

import (
	"context"
	"fmt"
	"os"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// ControllerContainer is the controller's container in its Deployment.
const ControllerContainer = "controller"

// OwnPod is the controller's own pod as "namespace/name", from
// $POD_NAMESPACE and $POD_NAME (the downward API); empty outside a pod.
func OwnPod() string {
	ns, name := os.Getenv("POD_NAMESPACE"), os.Getenv("POD_NAME")
	if ns == "" || name == "" {
		return ""
	}
	return ns + "/" + name
}

// OwnImage reads the controller's image from its own pod ($POD_NAMESPACE and
// $POD_NAME, from the downward API): the image kustomize's images: set, a
// mirror's included, which the cni kind's Job then runs too. Outside a pod
// it is empty, and the cni kind refuses to start a Job.
func OwnImage(ctx context.Context, cfg *rest.Config) (string, error) {
	ns, name := os.Getenv("POD_NAMESPACE"), os.Getenv("POD_NAME")
	if ns == "" || name == "" {
		return "", nil
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return "", err
	}
	pod, err := cs.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return "", fmt.Errorf("read the controller's own pod %s/%s for its image (or pass --image): %w", ns, name, err)
	}
	for _, c := range pod.Spec.Containers {
		if c.Name == ControllerContainer {
			return c.Image, nil
		}
	}
	return "", fmt.Errorf("pod %s/%s has no container %q: pass --image", ns, name, ControllerContainer)
}
