// Package repo finds the Ichor checkout the tests and the sandbox run in.
package repo

import (
	"errors"
	"os"
	"path/filepath"
)

// Root finds the repository root by walking up from the working directory
// to go.mod.
func Root() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("no go.mod above the working directory: run inside the Ichor repository")
		}
		dir = parent
	}
}
