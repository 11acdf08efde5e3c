package main

import (
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// tailLines is how much of each kept log a failed demo prints: enough to
// see what each component did last.
const tailLines = 40

// KeepLogs copies the sandbox's logs (sim.log, the output of each pod it
// ran as a process under pods/, each control plane's kube-apiserver,
// kube-controller-manager and kube-scheduler and etcd's under
// control-plane/) into a new directory under os.TempDir(), which Stop
// does not remove: a failed demo keeps what explains it. Only *.log files
// are copied: the kubeconfigs, tokens and keys beside them stay behind.
func (s *Sandbox) KeepLogs() (string, error) {
	kept, err := os.MkdirTemp("", "ichor-sandbox-logs-")
	if err != nil {
		return "", err
	}
	err = filepath.WalkDir(s.cfg.Dir, func(path string, e fs.DirEntry, err error) error {
		if err != nil || e.IsDir() || !strings.HasSuffix(path, ".log") {
			return err
		}
		rel, err := filepath.Rel(s.cfg.Dir, path)
		if err != nil {
			return err
		}
		return copyFile(path, filepath.Join(kept, rel))
	})
	return kept, err
}

// copyFile copies src to dst, making dst's directory.
func copyFile(src, dst string) error {
	if err := os.MkdirAll(filepath.Dir(dst), 0o700); err != nil {
		return err
	}
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close() //nolint:errcheck
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		_ = out.Close()
		return err
	}
	return out.Close()
}

// logTails writes the last n lines of every log under dir, each under its
// path, in the order of the paths.
func logTails(w io.Writer, dir string, n int) error {
	return filepath.WalkDir(dir, func(path string, e fs.DirEntry, err error) error {
		if err != nil || e.IsDir() {
			return err
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, path)
		fmt.Fprintf(w, "\n==> %s (the last %d lines) <==\n%s", rel, n, lastLines(string(b), n))
		return nil
	})
}

// lastLines is the last n lines of s.
func lastLines(s string, n int) string {
	s = strings.TrimRight(s, "\n")
	i := len(s)
	for ; n > 0; n-- {
		j := strings.LastIndexByte(s[:i], '\n')
		if j < 0 {
			return s + "\n"
		}
		i = j
	}
	return s[i+1:] + "\n"
}
