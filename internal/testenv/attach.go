package testenv

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
)

// Attach is an Env for an API server that something else runs (the
// control planes of a fleet that host the API, sim.Spec.Hosted): clients
// and a kubeconfig for cfg, an admin's, and Ichor's CRD installed. Those
// control planes run the controller manager and scheduler too
// (sim.Hosted.Components), so StartComponents is refused; so are User and
// UserKubeconfig, which need envtest's CA. Stop stops only what the Env
// started.
func Attach(cfg *rest.Config) (*Env, error) {
	root, err := RepoRoot()
	if err != nil {
		return nil, err
	}
	e := &Env{Config: rest.CopyConfig(cfg), Root: root}
	if err := e.initClients(); err != nil {
		return nil, err
	}
	if e.dir, err = os.MkdirTemp("", "ichor-testenv-"); err != nil {
		return nil, err
	}
	if e.Kubeconfig, err = writeKubeconfig(filepath.Join(e.dir, "kubeconfig-admin"), e.Config); err != nil {
		return nil, err
	}
	if _, err := envtest.InstallCRDs(e.Config, envtest.CRDInstallOptions{
		Paths: []string{filepath.Join(root, "manifests", "crd")}, ErrorIfPathMissing: true, Scheme: Scheme,
	}); err != nil {
		_ = os.RemoveAll(e.dir)
		return nil, fmt.Errorf("install the CRD: %w", err)
	}
	return e, nil
}

// writeKubeconfig writes a kubeconfig for cfg (certificate credentials).
func writeKubeconfig(path string, cfg *rest.Config) (string, error) {
	kc := clientcmdapi.Config{
		Clusters:       map[string]*clientcmdapi.Cluster{"cluster": {Server: cfg.Host, CertificateAuthorityData: cfg.CAData}},
		AuthInfos:      map[string]*clientcmdapi.AuthInfo{"admin": {ClientCertificateData: cfg.CertData, ClientKeyData: cfg.KeyData, Token: cfg.BearerToken}},
		Contexts:       map[string]*clientcmdapi.Context{"admin": {Cluster: "cluster", AuthInfo: "admin"}},
		CurrentContext: "admin",
	}
	data, err := clientcmd.Write(kc)
	if err != nil {
		return "", err
	}
	return path, os.WriteFile(path, data, 0o600)
}

var errAttached = errors.New("an attached Env (testenv.Attach) has no envtest CA to mint users with: use its Config")

var errAttachedComponents = errors.New("an attached Env (testenv.Attach) runs no components: the fleet's control planes do (sim.Hosted.Components)")
