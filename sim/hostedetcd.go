package sim

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"github.com/siderolabs/talos/pkg/machinery/api/common"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"maesh.dev/ichor/internal/controlplane"
)

// hostedEtcd is the etcd of a hosted fleet (Spec.Hosted): one real etcd
// process holding the cluster's data, which the API servers store in. The
// etcd model (etcdCluster) keeps the membership Talos's API answers with;
// the process follows it: it serves while the model's cluster has a
// leader (a quorum of its members up), stops when that quorum is lost
// (every control plane shut down, or rebooting at once), and starts again
// on the same data directory when it is back. The data goes when the last
// member's is wiped (EPHEMERAL reset, etcd leave); a Bootstrap makes a new
// cluster, from an uploaded snapshot restored with etcdutl as Talos does.
type hostedEtcd struct {
	f          *Fleet
	assets     string
	dir        string // holds each generation's data directory, the log
	name       string // the member's name
	host       string // its loopback address, of the fleet's block
	mu         sync.Mutex
	client     string      // client URL, https on host
	clientTLS  *tls.Config // the sim's own client's: a certificate of the etcd CA
	peer       string      // peer URL
	gen        int         // of the data: each Bootstrap makes a new cluster
	proc       *controlplane.Process
	cancel     context.CancelFunc // of the start in flight
	serving    chan struct{}      // closed while proc serves
	starts     int
	lastStart  time.Duration
	lastFailed error
}

func newHostedEtcd(f *Fleet, assets, dir string) (*hostedEtcd, error) {
	e := &hostedEtcd{
		f: f, assets: assets, dir: filepath.Join(dir, "etcd"), name: f.spec.Name,
		host:    f.block + ".0.254", // beside the machines' x.y.1-250, never one of them
		serving: make(chan struct{}),
	}
	if err := e.pickPorts(); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(e.dir, 0o700); err != nil {
		return nil, err
	}
	return e, e.writeTLS()
}

// TLS files etcd serves its clients with, in its directory.
const (
	etcdCAFile   = "ca.crt"
	etcdCertFile = "server.crt"
	etcdKeyFile  = "server.key"
)

// writeTLS writes etcd's serving certificate and the CA it trusts clients
// of, and makes the sim's own client's TLS.
func (e *hostedEtcd) writeTLS() error {
	ca := e.f.secrets.Certs.Etcd
	crt, err := etcdServerCert(ca, e.host)
	if err != nil {
		return err
	}
	for name, data := range map[string][]byte{etcdCAFile: ca.Crt, etcdCertFile: crt.Crt, etcdKeyFile: crt.Key} {
		if err := os.WriteFile(filepath.Join(e.dir, name), data, 0o600); err != nil {
			return err
		}
	}
	e.clientTLS, err = etcdClientTLS(ca, "sim")
	return err
}

// pickPorts gives etcd two free ports on its own address. Another process
// can still bind one before etcd does (the ports are only probed), but on
// an address of the fleet's block only a wildcard listener can: the
// connections every test makes to 127.0.0.1 leave from 127.0.0.1's ports.
func (e *hostedEtcd) pickPorts() error {
	var ports []int
	for range 2 {
		l, err := net.Listen("tcp", net.JoinHostPort(e.host, "0"))
		if err != nil {
			return fmt.Errorf("find a port for etcd on %s: %w", e.host, err)
		}
		defer l.Close()
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	e.client = "https://" + net.JoinHostPort(e.host, strconv.Itoa(ports[0]))
	e.peer = "http://" + net.JoinHostPort(e.host, strconv.Itoa(ports[1]))
	return nil
}

func (e *hostedEtcd) dataDir() string { return filepath.Join(e.dir, "data-"+strconv.Itoa(e.gen)) }

// follow makes the process follow the model: it runs while the cluster has
// quorum; without a member that holds data, the data is gone.
func (e *hostedEtcd) follow(quorum, anyData bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	switch {
	case quorum && e.cancel == nil && e.f.ctx.Err() == nil:
		ctx, cancel := context.WithCancel(e.f.ctx)
		e.cancel = cancel
		dir := e.dataDir()
		e.f.wg.Go(func() { e.start(ctx, dir) })
	case !quorum:
		e.stopLocked("its cluster lost quorum")
	}
	if !anyData && !quorum {
		_ = os.RemoveAll(e.dataDir())
	}
}

// args are the flags Talos gives etcd that matter here: a new cluster of
// this one member when its data directory is empty, else what the data
// directory holds.
func (e *hostedEtcd) args(dir string) []string {
	args := []string{
		"--name=" + e.name, "--data-dir=" + dir,
		"--listen-client-urls=" + e.client, "--advertise-client-urls=" + e.client,
		"--listen-peer-urls=" + e.peer, "--initial-advertise-peer-urls=" + e.peer,
		"--watch-progress-notify-interval=5s", "--log-level=warn",
		// As envtest's etcd: the data outlives the process (a kill, a
		// restart), only not the machine's crash; fsync would cost every
		// write a disk flush on a machine the tests share.
		"--unsafe-no-fsync",
		// Clients present a certificate of the etcd CA, as Talos's etcd requires.
		"--client-cert-auth=true", "--trusted-ca-file=" + filepath.Join(e.dir, etcdCAFile),
		"--cert-file=" + filepath.Join(e.dir, etcdCertFile), "--key-file=" + filepath.Join(e.dir, etcdKeyFile),
	}
	if empty, _ := isDirEmpty(dir); empty {
		args = append(args, "--initial-cluster="+e.name+"="+e.peer, "--initial-cluster-state=new")
	}
	return args
}

func isDirEmpty(dir string) (bool, error) {
	entries, err := os.ReadDir(dir)
	if os.IsNotExist(err) {
		return true, nil
	}
	return len(entries) == 0, err
}

// errPortTaken is a start that failed because another process bound one of
// etcd's ports first.
var errPortTaken = errors.New("a port of etcd's is taken")

// start starts etcd on dir. When another process took one of its ports it
// moves to new ones and tries again, then restarts the API servers that
// were given the old client URL: the collision is the machine's (tests in
// parallel), not the cluster's.
func (e *hostedEtcd) start(ctx context.Context, dir string) {
	began := time.Now()
	var p *controlplane.Process
	var err error
	moved := false
	for try := 1; ; try++ {
		p, err = e.startOnce(ctx, dir)
		if !errors.Is(err, errPortTaken) || ctx.Err() != nil || try == 3 {
			break
		}
		if err = e.movePorts(); err != nil {
			break
		}
		moved = true
	}
	if !e.serve(ctx, p, err, dir, began) || !moved {
		return
	}
	e.f.restartAPIServers()
}

// movePorts gives etcd new ports after a start found one taken.
func (e *hostedEtcd) movePorts() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	was := e.client
	if err := e.pickPorts(); err != nil {
		return err
	}
	e.f.logf("etcd: %v; moving from %s to %s", errPortTaken, was, e.client)
	return nil
}

func (e *hostedEtcd) logPath() string { return filepath.Join(e.dir, "etcd.log") }

// startOnce starts the process once and waits until it is ready.
func (e *hostedEtcd) startOnce(ctx context.Context, dir string) (*controlplane.Process, error) {
	log, err := os.OpenFile(e.logPath(), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	if err != nil {
		return nil, err
	}
	defer log.Close()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	from, _ := log.Seek(0, io.SeekEnd)
	e.mu.Lock()
	args, client := e.args(dir), e.client
	e.mu.Unlock()
	p, err := controlplane.StartEtcd(ctx, controlplane.Etcd{Assets: e.assets, Args: args, ClientURL: client, ClientTLS: e.clientTLS, Log: log})
	if err != nil && bytes.Contains(logSince(e.logPath(), from), []byte("address already in use")) {
		return nil, fmt.Errorf("%w: %w", errPortTaken, err)
	}
	return p, err
}

// serve records the outcome of a start; it reports whether etcd serves.
func (e *hostedEtcd) serve(ctx context.Context, p *controlplane.Process, err error, dir string, began time.Time) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	if err != nil {
		if ctx.Err() == nil {
			e.lastFailed = fmt.Errorf("etcd: %w; the end of its log:\n%s", err, logTail(e.logPath()))
			e.f.logf("%v", e.lastFailed)
			e.cancel = nil // the next change of the model tries again
		}
		return false
	}
	if ctx.Err() != nil {
		p.Stop()
		return false
	}
	e.proc, e.lastFailed = p, nil
	e.starts++
	e.lastStart = time.Since(began)
	close(e.serving)
	e.f.logf("etcd serves on %s in %s (data %s)", e.client, e.lastStart.Round(time.Millisecond), dir)
	return true
}

// logSince is what a log holds from offset on.
func logSince(path string, offset int64) []byte {
	b, _ := os.ReadFile(path)
	return b[min(offset, int64(len(b))):]
}

func (e *hostedEtcd) stopLocked(why string) {
	if e.cancel != nil {
		e.cancel()
		e.cancel = nil
	}
	if e.proc == nil {
		return
	}
	e.proc.Stop()
	e.proc = nil
	e.serving = make(chan struct{})
	e.f.logf("etcd stopped: %s", why)
}

// stop stops etcd for good (the fleet stops).
func (e *hostedEtcd) stop() {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.stopLocked("the fleet stops")
}

// clientURL is where etcd serves clients (it moves when a port was taken).
func (e *hostedEtcd) clientURL() string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.client
}

// wait waits until etcd serves, as a kube-apiserver static pod that
// cannot reach its etcd restarts until it can.
func (e *hostedEtcd) wait(ctx context.Context) error {
	for {
		e.mu.Lock()
		serving := e.serving
		e.mu.Unlock()
		select {
		case <-serving:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// EtcdStatus is the state of a hosted fleet's etcd process.
type EtcdStatus struct {
	// ClientURL is where it serves clients; empty without Spec.Hosted.
	ClientURL string
	// Serving is true while it runs and serves.
	Serving bool
	// Starts counts the times it started serving.
	Starts int
	// LastStart is how long its last start took.
	LastStart time.Duration
}

// HostedEtcd is the state of the etcd of a fleet under Spec.Hosted.
func (f *Fleet) HostedEtcd() EtcdStatus {
	if f.hosting == nil {
		return EtcdStatus{}
	}
	e := f.hosting.etcd
	e.mu.Lock()
	defer e.mu.Unlock()
	return EtcdStatus{ClientURL: e.client, Serving: e.proc != nil, Starts: e.starts, LastStart: e.lastStart}
}

// stopGrace is how long a control-plane component stopping with its
// machine gets between SIGTERM and SIGKILL. A kube-apiserver has stopped
// listening and drained its requests within about a second, and then
// sometimes does not exit for as long as it may (its log ends with its
// controllers shut down); without etcd its graceful shutdown waits out its
// storage, and the controller manager and the scheduler try to give their
// leases back to an API that cannot store them. Nobody can see the wait
// (the balancer has dropped the machine's API server already), and every
// control-plane reboot in the tests would pay it, so it is cut short.
func (f *Fleet) stopGrace(apiServer bool) time.Duration {
	switch {
	case !f.apiStores():
		return time.Second
	case apiServer:
		return 3 * time.Second
	}
	return 10 * time.Second
}

// apiStores reports whether the API can store anything: always with a
// fixed API server; under Spec.Hosted while etcd serves.
func (f *Fleet) apiStores() bool { return f.hosting == nil || f.HostedEtcd().Serving }

// snapshot streams a snapshot of etcd to srv in chunks, as Talos's
// EtcdSnapshot does through etcd's maintenance Snapshot.
func (e *hostedEtcd) snapshot(ctx context.Context, srv grpc.ServerStreamingServer[common.Data]) error {
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{e.clientURL()}, TLS: e.clientTLS, DialTimeout: 5 * time.Second, Context: ctx, Logger: zap.NewNop()})
	if err != nil {
		return fmt.Errorf("failed to create etcd client: %w", err)
	}
	defer cli.Close()
	resp, err := cli.SnapshotWithVersion(ctx)
	if err != nil {
		return fmt.Errorf("failed reading etcd snapshot: %w", err)
	}
	defer resp.Snapshot.Close()
	buf := make([]byte, 4096)
	for {
		n, err := resp.Snapshot.Read(buf)
		if n > 0 {
			if err := srv.Send(&common.Data{Bytes: bytes.Clone(buf[:n])}); err != nil {
				return err
			}
		}
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return fmt.Errorf("failed reading etcd snapshot: %w", err)
		}
	}
}

// bootstrap makes a new cluster's data: empty, or restored from snap with
// etcdutl as Talos's recoverFromSnapshot does (Status, then Restore into
// the empty data directory as a single-member cluster, no revision bump).
// It returns the snapshot's revision. A snapshot it cannot restore changes
// nothing. The process starts once the model has the new cluster's leader.
func (e *hostedEtcd) bootstrap(ctx context.Context, snap []byte, skipHash bool) (int64, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	next := filepath.Join(e.dir, "data-"+strconv.Itoa(e.gen+1))
	_ = os.RemoveAll(next)
	var rev int64
	if snap != nil {
		var err error
		if rev, err = e.restore(ctx, snap, skipHash, next); err != nil {
			_ = os.RemoveAll(next)
			return 0, err
		}
	}
	e.stopLocked("a bootstrap makes a new cluster")
	_ = os.RemoveAll(e.dataDir())
	e.gen++
	return rev, nil
}

// restore checks snap with `etcdutl snapshot status` and restores it into
// dir with `etcdutl snapshot restore`.
func (e *hostedEtcd) restore(ctx context.Context, snap []byte, skipHash bool, dir string) (int64, error) {
	path := filepath.Join(e.dir, "etcd.snapshot")
	if err := os.WriteFile(path, snap, 0o600); err != nil {
		return 0, fmt.Errorf("error writing the recovery snapshot: %w", err)
	}
	defer os.Remove(path)
	out, err := e.etcdutl(ctx, "snapshot", "status", path, "-w", "json")
	if err != nil {
		return 0, status.Errorf(codes.InvalidArgument, "error verifying snapshot: %v", err)
	}
	var st struct {
		Hash      uint32 `json:"hash"`
		Revision  int64  `json:"revision"`
		TotalKey  int    `json:"totalKey"`
		TotalSize int64  `json:"totalSize"`
	}
	if err := json.Unmarshal(out, &st); err != nil {
		return 0, fmt.Errorf("etcdutl snapshot status: %w: %s", err, out)
	}
	e.f.logf("recovering etcd from snapshot: hash %08x, revision %d, total keys %d, total size %d", st.Hash, st.Revision, st.TotalKey, st.TotalSize)
	args := []string{"snapshot", "restore", path, "--data-dir=" + dir, "--name=" + e.name,
		"--initial-cluster=" + e.name + "=" + e.peer, "--initial-advertise-peer-urls=" + e.peer}
	if skipHash {
		args = append(args, "--skip-hash-check")
	}
	if _, err := e.etcdutl(ctx, args...); err != nil {
		return 0, status.Errorf(codes.InvalidArgument, "error recovering from the snapshot: %v", err)
	}
	return st.Revision, nil
}

// etcdutl runs the etcdutl binary beside etcd and returns its output.
func (e *hostedEtcd) etcdutl(ctx context.Context, args ...string) ([]byte, error) {
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, filepath.Join(e.assets, "etcdutl"), args...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("etcdutl %s: %w: %s", args[1], err, bytes.TrimSpace(stderr.Bytes()))
	}
	return stdout.Bytes(), nil
}

// follow ends every change of the etcd model under Spec.Hosted: the etcd
// process follows it.
func (e *etcdCluster) follow() {
	h := e.f.hosting
	if h == nil {
		return
	}
	e.mu.Lock()
	quorum := e.leader != 0
	e.mu.Unlock()
	anyData := false
	for _, m := range e.f.controlPlanes {
		m.mu.Lock()
		anyData = anyData || m.etcdData
		m.mu.Unlock()
	}
	h.etcd.follow(quorum, anyData)
}

// restartAPIServers restarts the control planes' API servers that run
// or start, after their etcd became a new cluster.
func (f *Fleet) restartAPIServers() {
	for _, m := range f.controlPlanes {
		a := m.apiServer
		a.mu.Lock()
		running := a.cancel != nil
		a.mu.Unlock()
		if running {
			a.stop()
			a.ensure()
		}
	}
}
