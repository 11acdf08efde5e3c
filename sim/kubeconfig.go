package sim

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"errors"
	"os"
	"time"

	"github.com/siderolabs/talos/pkg/machinery/api/common"
	"github.com/siderolabs/talos/pkg/machinery/config"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/emptypb"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"maesh.dev/ichor/internal/kubepki"
)

// Kubeconfig answers on a control plane with an admin kubeconfig for the
// cluster's API server, as Talos does: one message holding a tar.gz with
// one file, "kubeconfig" (mode 0600), whose cluster, user and context are
// named <cluster>, admin@<cluster> and admin@<cluster> after the machine
// configuration's cluster name, in namespace default. On a hosted fleet
// it is Talos's (pkg/kubeconfig GenerateAdmin, 1.13): a new admin
// certificate from the machine's cluster.ca, trusting cluster.acceptedCAs
// then cluster.ca, for the fleet's endpoint; so it follows a Kubernetes CA
// rotation. Otherwise the API server is the one Spec.APIServer names, and
// its credentials are those.
func (s *machined) Kubeconfig(_ *emptypb.Empty, srv grpc.ServerStreamingServer[common.Data]) error {
	m := callee(srv.Context())
	if err := checkControlPlane(m, "kubeconfig"); err != nil {
		return err
	}
	api := m.f.spec.APIServer
	if api == nil {
		return status.Error(codes.FailedPrecondition, "this simulated cluster has no API server (sim.Spec.APIServer is not set)")
	}
	var data []byte
	var err error
	if m.f.hosting != nil {
		data, err = hostedKubeconfig(m.Config(), api.Host)
	} else {
		data, err = adminKubeconfig(m.Config().Cluster().Name(), api.Host, api.CAData, api.CAFile, api.CertData, api.KeyData, api.BearerToken)
	}
	if err != nil {
		return status.Errorf(codes.Internal, "generate kubeconfig: %v", err)
	}
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	tw := tar.NewWriter(zw)
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: "kubeconfig", Size: int64(len(data)), ModTime: time.Now(), Mode: 0o600}); err != nil {
		return err
	}
	if _, err := tw.Write(data); err != nil {
		return err
	}
	// Talos closes the gzip stream only, as here: the tar end marker is left out.
	if err := zw.Close(); err != nil {
		return err
	}
	return srv.Send(&common.Data{Bytes: buf.Bytes()})
}

func adminKubeconfig(cluster, server string, ca []byte, caFile string, cert, key []byte, token string) ([]byte, error) {
	if len(ca) == 0 && caFile != "" {
		var err error
		if ca, err = os.ReadFile(caFile); err != nil {
			return nil, err
		}
	}
	user := "admin@" + cluster
	cfg := clientcmdapi.Config{
		Clusters:       map[string]*clientcmdapi.Cluster{cluster: {Server: server, CertificateAuthorityData: ca}},
		AuthInfos:      map[string]*clientcmdapi.AuthInfo{user: {ClientCertificateData: cert, ClientKeyData: key, Token: token}},
		Contexts:       map[string]*clientcmdapi.Context{user: {Cluster: cluster, AuthInfo: user, Namespace: "default"}},
		CurrentContext: user,
	}
	return clientcmd.Write(cfg)
}

// hostedKubeconfig is Talos's admin kubeconfig of cfg for server.
func hostedKubeconfig(cfg config.Provider, server string) ([]byte, error) {
	c := cfg.Cluster()
	ca := c.IssuingCA()
	if ca == nil || len(ca.Key) == 0 {
		return nil, errors.New("issuing CA is not set")
	}
	crt, err := kubepki.Admin(ca)
	if err != nil {
		return nil, err
	}
	var trust []byte
	for _, a := range c.AcceptedCAs() {
		trust = append(trust, a.Crt...)
	}
	trust = append(trust, ca.Crt...)
	return adminKubeconfig(c.Name(), server, trust, "", crt.Crt, crt.Key, "")
}
