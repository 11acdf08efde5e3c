package sim

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// tokenLifetime is how long the ServiceAccount token of a process lasts
// (the kubelet's default for projected tokens). It is not renewed.
const tokenLifetime = time.Hour

// process is a container's binary running as a local process, in its own
// process group so that its children go with it.
type process struct {
	cmd  *exec.Cmd
	done chan struct{}
	once sync.Once
}

// spawn starts the container's binary as a process with the container's
// command, args and environment (downward API, ConfigMap and Secret
// references resolved), KUBECONFIG pointing at a kubeconfig for the
// pod's ServiceAccount with a token from the TokenRequest API, bound to the
// pod, and TMPDIR at the container's own /tmp (tmpDir). exited is called with the exit code (128+signal when killed) and,
// for terminationMessagePolicy FallbackToLogsOnError, the end of its output.
func (r *podRun) spawn(c *ctr, bin string, exited func(code int, msg string)) (*process, error) {
	ctx, cancel := r.kl.k.ctx()
	defer cancel()
	env, vars, err := r.environment(ctx, c.spec)
	if err != nil {
		return nil, err
	}
	args, err := commandLine(c.spec, bin, vars)
	if err != nil {
		return nil, err
	}
	dir, err := r.kl.podDir(r.pod)
	if err != nil {
		return nil, err
	}
	kubeconfig, err := r.writeKubeconfig(ctx, dir)
	if err != nil {
		return nil, err
	}
	tmp, err := tmpDir(r.pod, c.spec, dir)
	if err != nil {
		return nil, err
	}
	logPath := filepath.Join(dir, c.spec.Name+".log")
	out, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, args...)
	cmd.Dir = dir
	cmd.Env = append(append([]string{"PATH=/usr/local/bin:/usr/bin:/bin", "HOSTNAME=" + r.pod.Name, "HOME=" + dir, "TMPDIR=" + tmp, "KUBECONFIG=" + kubeconfig},
		r.kl.runtimeEnv()...), env...)
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	start, _ := os.Stat(logPath)
	if err := cmd.Start(); err != nil {
		out.Close()
		return nil, fmt.Errorf("start %s: %w", bin, err)
	}
	p := &process{cmd: cmd, done: make(chan struct{})}
	r.kl.k.f.wg.Add(1)
	go func() {
		defer r.kl.k.f.wg.Done()
		err := cmd.Wait()
		out.Close()
		close(p.done)
		code := exitCode(cmd, err)
		msg := ""
		if code != 0 {
			tail := outputTail(logPath, start)
			r.kl.k.f.logf("pod %s/%s: container %s exited %d: %s", r.pod.Namespace, r.pod.Name, c.spec.Name, code, lastLine(tail))
			if c.spec.TerminationMessagePolicy == corev1.TerminationMessageFallbackToLogsOnError {
				msg = tail
			}
		}
		exited(code, msg)
	}()
	return p, nil
}

// tmpDir is the container's /tmp, which its process finds in TMPDIR (as
// os.TempDir does), under the pod's directory dir: the emptyDir volume the
// container mounts at /tmp, which outlives the container's restarts as a
// kubelet keeps an emptyDir for the pod's life, or else a directory of the
// container's own, empty at each start as a new container's writable layer
// is. Never the machine's /tmp, which every process on it shares: no
// container sees another's /tmp, and ichor-controller keeps there what an
// etcd restore resumes from when its container restarts (another
// controller that found it there would resume that restore too).
func tmpDir(pod *corev1.Pod, c corev1.Container, dir string) (string, error) {
	if name := tmpVolume(pod, c); name != "" {
		d := filepath.Join(dir, "volumes", name)
		return d, os.MkdirAll(d, 0o700)
	}
	d := filepath.Join(dir, "tmp", c.Name)
	if err := os.RemoveAll(d); err != nil {
		return "", err
	}
	return d, os.MkdirAll(d, 0o700)
}

// tmpVolume names the emptyDir volume the container mounts at /tmp, or "".
func tmpVolume(pod *corev1.Pod, c corev1.Container) string {
	for _, vm := range c.VolumeMounts {
		if filepath.Clean(vm.MountPath) != "/tmp" {
			continue
		}
		for _, v := range pod.Spec.Volumes {
			if v.Name == vm.Name && v.EmptyDir != nil {
				return v.Name
			}
		}
	}
	return ""
}

// runtimeEnv is Kubelet.Env as NAME=value, sorted.
func (kl *kubelet) runtimeEnv() []string {
	out := make([]string, 0, len(kl.k.f.spec.Kubelet.Env))
	for k, v := range kl.k.f.spec.Kubelet.Env {
		out = append(out, k+"="+v)
	}
	sort.Strings(out)
	return out
}

// commandLine is the process's arguments: the container's command (whose
// first word must name the image's binary, as the image's own path would)
// and args, with $(VAR) references expanded from the container's env.
func commandLine(c corev1.Container, bin string, vars map[string]string) ([]string, error) {
	var args []string
	if len(c.Command) > 0 {
		if filepath.Base(c.Command[0]) != filepath.Base(bin) {
			return nil, fmt.Errorf("exec: %q: executable file not found in $PATH (the image runs only %s)", c.Command[0], filepath.Base(bin))
		}
		args = append(args, c.Command[1:]...)
	}
	args = append(args, c.Args...)
	for i := range args {
		args[i] = expand(args[i], vars)
	}
	return args, nil
}

// expand replaces $(VAR) with the variable's value, as the kubelet does:
// unknown references stay as they are, and $$ escapes a $.
func expand(s string, vars map[string]string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] != '$' || i+1 >= len(s) {
			b.WriteByte(s[i])
			continue
		}
		switch s[i+1] {
		case '$':
			b.WriteByte('$')
			i++
		case '(':
			end := strings.IndexByte(s[i+2:], ')')
			if end < 0 {
				b.WriteString(s[i:])
				return b.String()
			}
			name := s[i+2 : i+2+end]
			if v, ok := vars[name]; ok {
				b.WriteString(v)
			} else {
				b.WriteString(s[i : i+3+end])
			}
			i += 2 + end
		default:
			b.WriteByte('$')
		}
	}
	return b.String()
}

// environment resolves the container's envFrom and env, in the kubelet's
// order (envFrom first, env after and winning), as NAME=value and as a map.
func (r *podRun) environment(ctx context.Context, c corev1.Container) ([]string, map[string]string, error) {
	vars := map[string]string{}
	var order []string
	set := func(k, v string) {
		if _, ok := vars[k]; !ok {
			order = append(order, k)
		}
		vars[k] = v
	}
	core := r.kl.k.cs.CoreV1()
	for _, from := range c.EnvFrom {
		var data map[string]string
		switch {
		case from.ConfigMapRef != nil:
			cm, err := core.ConfigMaps(r.pod.Namespace).Get(ctx, from.ConfigMapRef.Name, metav1.GetOptions{})
			if err != nil {
				if apierrors.IsNotFound(err) && isTrue(from.ConfigMapRef.Optional) {
					continue
				}
				return nil, nil, fmt.Errorf("configmap %q: %w", from.ConfigMapRef.Name, err)
			}
			data = cm.Data
		case from.SecretRef != nil:
			s, err := core.Secrets(r.pod.Namespace).Get(ctx, from.SecretRef.Name, metav1.GetOptions{})
			if err != nil {
				if apierrors.IsNotFound(err) && isTrue(from.SecretRef.Optional) {
					continue
				}
				return nil, nil, fmt.Errorf("secret %q: %w", from.SecretRef.Name, err)
			}
			data = map[string]string{}
			for k, v := range s.Data {
				data[k] = string(v)
			}
		}
		keys := make([]string, 0, len(data))
		for k := range data {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			set(from.Prefix+k, data[k])
		}
	}
	for _, e := range c.Env {
		if e.ValueFrom == nil {
			set(e.Name, expand(e.Value, vars))
			continue
		}
		v, ok, err := r.valueFrom(ctx, c, e.ValueFrom)
		if err != nil {
			return nil, nil, fmt.Errorf("env %s: %w", e.Name, err)
		}
		if ok {
			set(e.Name, v)
		}
	}
	out := make([]string, 0, len(order))
	for _, k := range order {
		out = append(out, k+"="+vars[k])
	}
	return out, vars, nil
}

// valueFrom resolves one env source: the downward API (fieldRef,
// resourceFieldRef), a ConfigMap key or a Secret key.
func (r *podRun) valueFrom(ctx context.Context, c corev1.Container, src *corev1.EnvVarSource) (string, bool, error) {
	core := r.kl.k.cs.CoreV1()
	switch {
	case src.FieldRef != nil:
		v, err := r.field(src.FieldRef.FieldPath)
		return v, err == nil, err
	case src.ResourceFieldRef != nil:
		v, err := resourceValue(c, src.ResourceFieldRef)
		return v, err == nil, err
	case src.ConfigMapKeyRef != nil:
		ref := src.ConfigMapKeyRef
		cm, err := core.ConfigMaps(r.pod.Namespace).Get(ctx, ref.Name, metav1.GetOptions{})
		if err == nil {
			if v, ok := cm.Data[ref.Key]; ok {
				return v, true, nil
			}
			err = fmt.Errorf("configmap %q has no key %q", ref.Name, ref.Key)
		}
		if isTrue(ref.Optional) {
			return "", false, nil
		}
		return "", false, err
	case src.SecretKeyRef != nil:
		ref := src.SecretKeyRef
		s, err := core.Secrets(r.pod.Namespace).Get(ctx, ref.Name, metav1.GetOptions{})
		if err == nil {
			if v, ok := s.Data[ref.Key]; ok {
				return string(v), true, nil
			}
			err = fmt.Errorf("secret %q has no key %q", ref.Name, ref.Key)
		}
		if isTrue(ref.Optional) {
			return "", false, nil
		}
		return "", false, err
	}
	return "", false, errors.New("no source set")
}

// field is a downward API field of the pod.
func (r *podRun) field(fieldPath string) (string, error) {
	p := r.pod
	if key, ok := subscript(fieldPath, "metadata.labels"); ok {
		return p.Labels[key], nil
	}
	if key, ok := subscript(fieldPath, "metadata.annotations"); ok {
		return p.Annotations[key], nil
	}
	switch fieldPath {
	case "metadata.name":
		return p.Name, nil
	case "metadata.namespace":
		return p.Namespace, nil
	case "metadata.uid":
		return string(p.UID), nil
	case "spec.nodeName":
		return p.Spec.NodeName, nil
	case "spec.serviceAccountName":
		return p.Spec.ServiceAccountName, nil
	case "status.hostIP", "status.hostIPs":
		return r.m.addr, nil
	case "status.podIP", "status.podIPs":
		return r.ip, nil
	}
	return "", fmt.Errorf("fieldRef %q is not a field the downward API offers", fieldPath)
}

func subscript(fieldPath, prefix string) (string, bool) {
	rest, ok := strings.CutPrefix(fieldPath, prefix+"['")
	if !ok || !strings.HasSuffix(rest, "']") {
		return "", false
	}
	return strings.TrimSuffix(rest, "']"), true
}

// resourceValue is a container's limit or request, in units of the
// divisor, rounded up; a missing limit is the Node's allocatable.
func resourceValue(c corev1.Container, ref *corev1.ResourceFieldSelector) (string, error) {
	kind, name, ok := strings.Cut(ref.Resource, ".")
	if !ok {
		return "", fmt.Errorf("resourceFieldRef %q", ref.Resource)
	}
	list := c.Resources.Limits
	if kind == "requests" {
		list = c.Resources.Requests
	}
	q, ok := list[corev1.ResourceName(name)]
	if !ok {
		q, ok = allocatable[corev1.ResourceName(name)]
		if !ok {
			return "0", nil
		}
	}
	div := ref.Divisor
	if div.IsZero() {
		div = resource.MustParse("1")
	}
	v := (q.MilliValue() + div.MilliValue() - 1) / div.MilliValue()
	return fmt.Sprint(v), nil
}

// allocatable is what every simulated Node offers (runningStatus).
var allocatable = corev1.ResourceList{
	corev1.ResourceCPU:    resource.MustParse("4"),
	corev1.ResourceMemory: resource.MustParse("8Gi"),
}

func isTrue(b *bool) bool { return b != nil && *b }

// writeKubeconfig writes a kubeconfig for the pod's ServiceAccount: the
// cluster's API server (Spec.APIServer) and a token the TokenRequest
// API issued for the ServiceAccount, bound to the pod (it stops working
// when the pod goes), in a file the kubeconfig names.
func (r *podRun) writeKubeconfig(ctx context.Context, dir string) (string, error) {
	api := r.kl.k.f.spec.APIServer
	if api == nil {
		return "", errors.New("the simulated kubelet has no API server to give the process (sim.Spec.APIServer is not set)")
	}
	sa := r.pod.Spec.ServiceAccountName
	if sa == "" {
		sa = "default"
	}
	seconds := int64(tokenLifetime / time.Second)
	tr, err := r.kl.k.cs.CoreV1().ServiceAccounts(r.pod.Namespace).CreateToken(ctx, sa, &authenticationv1.TokenRequest{
		Spec: authenticationv1.TokenRequestSpec{
			ExpirationSeconds: &seconds,
			BoundObjectRef:    &authenticationv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: r.pod.Name, UID: r.pod.UID},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		return "", fmt.Errorf("token for ServiceAccount %s/%s: %w", r.pod.Namespace, sa, err)
	}
	tokenFile := filepath.Join(dir, "token")
	if err := os.WriteFile(tokenFile, []byte(tr.Status.Token), 0o600); err != nil {
		return "", err
	}
	ca := api.CAData
	if len(ca) == 0 && api.CAFile != "" {
		if ca, err = os.ReadFile(api.CAFile); err != nil {
			return "", err
		}
	}
	name := "sim-" + r.kl.k.f.spec.Name
	cfg := clientcmdapi.Config{
		Clusters:       map[string]*clientcmdapi.Cluster{name: {Server: api.Host, CertificateAuthorityData: ca, TLSServerName: api.ServerName}},
		AuthInfos:      map[string]*clientcmdapi.AuthInfo{sa: {TokenFile: tokenFile}},
		Contexts:       map[string]*clientcmdapi.Context{name: {Cluster: name, AuthInfo: sa, Namespace: r.pod.Namespace}},
		CurrentContext: name,
	}
	path := filepath.Join(dir, "kubeconfig")
	return path, clientcmd.WriteToFile(cfg, path)
}

// podDir is the directory of one pod's files, under Kubelet.Dir.
func (kl *kubelet) podDir(pod *corev1.Pod) (string, error) {
	kl.mu.Lock()
	if kl.dir == "" {
		if d := kl.k.f.spec.Kubelet.Dir; d != "" {
			kl.dir = d
		} else {
			d, err := os.MkdirTemp("", "ichor-sim-kubelet-")
			if err != nil {
				kl.mu.Unlock()
				return "", err
			}
			kl.dir, kl.tempDir = d, true
		}
	}
	dir := filepath.Join(kl.dir, pod.Namespace+"_"+pod.Name+"_"+string(pod.UID))
	kl.mu.Unlock()
	return dir, os.MkdirAll(dir, 0o700)
}

func (kl *kubelet) removeFiles(pod *corev1.Pod) {
	kl.mu.Lock()
	root := kl.dir
	kl.mu.Unlock()
	if root != "" {
		_ = os.RemoveAll(filepath.Join(root, pod.Namespace+"_"+pod.Name+"_"+string(pod.UID)))
	}
}

func exitCode(cmd *exec.Cmd, err error) int {
	if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return 128 + int(ws.Signal())
	}
	if err != nil && cmd.ProcessState == nil {
		return exitStartError
	}
	return cmd.ProcessState.ExitCode()
}

// outputTail is the end of what the process wrote (since start), as the
// kubelet takes it for a termination message: at most 80 lines, 2 KiB.
func outputTail(path string, before os.FileInfo) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	if before != nil && before.Size() <= int64(len(data)) {
		data = data[before.Size():]
	}
	if len(data) > 2048 {
		data = data[len(data)-2048:]
	}
	lines := bytes.Split(bytes.TrimRight(data, "\n"), []byte("\n"))
	if len(lines) > 80 {
		lines = lines[len(lines)-80:]
	}
	return string(bytes.Join(lines, []byte("\n")))
}

func lastLine(s string) string {
	if i := strings.LastIndexByte(s, '\n'); i >= 0 {
		return s[i+1:]
	}
	return s
}

// terminate sends SIGTERM to the process group, and SIGKILL after grace.
func (p *process) terminate(grace time.Duration) {
	_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGTERM)
	go func() {
		select {
		case <-p.done:
		case <-time.After(grace):
			p.kill()
		}
	}()
}

// kill ends the process group at once, as a machine going down does.
func (p *process) kill() {
	p.once.Do(func() { _ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL) })
}
