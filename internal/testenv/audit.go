package testenv

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"
)

// AuditedUser is the user whose requests the API server's audit log
// records, one line each as the request arrives; no other user's are
// logged. A benchmark runs the controller as this user to count the
// requests it makes where they land, at the API server.
const AuditedUser = "ichor-audited"

// auditPolicy logs AuditedUser's requests at their arrival (the stage
// RequestReceived, so a watch counts once, when it opens) and nothing else.
const auditPolicy = `apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [ResponseStarted, ResponseComplete, Panic]
rules:
  - level: Metadata
    users: [` + AuditedUser + `]
  - level: None
`

// auditArgs writes the audit policy into dir and returns the API server's
// flags that turn the log on, and the log's path.
func auditArgs(dir string) (map[string]string, string, error) {
	policy := filepath.Join(dir, "audit-policy.yaml")
	if err := os.WriteFile(policy, []byte(auditPolicy), 0o600); err != nil {
		return nil, "", fmt.Errorf("write the audit policy: %w", err)
	}
	log := filepath.Join(dir, "audit.log")
	return map[string]string{"audit-policy-file": policy, "audit-log-path": log, "audit-log-format": "json"}, log, nil
}

// Request is one request of the audit log.
type Request struct {
	Verb string
	// Resource and Subresource are the object's ("talosoperations", "status").
	Resource, Subresource string
	Namespace, Name       string
	At                    time.Time
}

// AuditedRequests reads AuditedUser's requests from the audit log, in the
// order they arrived. The log is written as requests arrive: call it once
// the requests to count have been answered.
func (e *Env) AuditedRequests() ([]Request, error) {
	if e.auditLog == "" {
		return nil, errors.New("this Env has no audit log (testenv.Attach does not start the API server)")
	}
	f, err := os.Open(e.auditLog)
	if err != nil {
		return nil, fmt.Errorf("open the audit log: %w", err)
	}
	defer f.Close()
	var out []Request
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64<<10), 4<<20)
	for sc.Scan() {
		var ev struct {
			Verb      string                    `json:"verb"`
			User      struct{ Username string } `json:"user"`
			ObjectRef *struct {
				Resource, Subresource, Namespace, Name string
			} `json:"objectRef"`
			RequestReceivedTimestamp time.Time `json:"requestReceivedTimestamp"`
		}
		if err := json.Unmarshal(sc.Bytes(), &ev); err != nil {
			return nil, fmt.Errorf("parse the audit log: %w", err)
		}
		if ev.User.Username != AuditedUser {
			continue
		}
		r := Request{Verb: ev.Verb, At: ev.RequestReceivedTimestamp}
		if o := ev.ObjectRef; o != nil {
			r.Resource, r.Subresource, r.Namespace, r.Name = o.Resource, o.Subresource, o.Namespace, o.Name
		}
		out = append(out, r)
	}
	return out, sc.Err()
}
