package talos

import (
	"fmt"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestInstallerImage(t *testing.T) {
	const schematic = "376567988ad370138ad8b2698212367b8edcb69b5fd68c80be1f2ec7d603b4ba"
	tests := []struct {
		name      string
		facts     Facts
		schematic string
		want      string
	}{
		{"the machine's schematic", Facts{Platform: "metal", Schematic: schematic}, "",
			"factory.talos.dev/metal-installer/" + schematic + ":v1.13.7"},
		{"the operation's schematic wins", Facts{Platform: "metal", Schematic: schematic}, "abc",
			"factory.talos.dev/metal-installer/abc:v1.13.7"},
		{"secure boot", Facts{Platform: "aws", Schematic: schematic, SecureBoot: true}, "",
			"factory.talos.dev/aws-installer-secureboot/" + schematic + ":v1.13.7"},
		{"no platform reported is metal", Facts{Schematic: schematic}, "",
			"factory.talos.dev/metal-installer/" + schematic + ":v1.13.7"},
		{"not booted from Image Factory", Facts{Platform: "metal"}, "",
			"ghcr.io/siderolabs/installer:v1.13.7"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := InstallerImage("factory.talos.dev", tt.facts, tt.schematic, "v1.13.7"); got != tt.want {
				t.Errorf("InstallerImage = %q, want %q", got, tt.want)
			}
		})
	}
}

func TestHasLifecycleAPI(t *testing.T) {
	for v, want := range map[string]bool{
		"v1.12.4": false, "v1.13.0-alpha.2": false, "v1.13.0-beta.0": true, "v1.13.0": true, "v1.13.7": true,
		"v2.0.0": true, "1.11.0": false, "garbage": false,
	} {
		if got := HasLifecycleAPI(v); got != want {
			t.Errorf("HasLifecycleAPI(%q) = %v, want %v", v, got, want)
		}
	}
}

func TestNotSent(t *testing.T) {
	for err, want := range map[error]bool{
		status.Error(codes.Unavailable, `connection error: desc = "transport: Error while dialing: dial tcp 127.0.0.1:50000: connect: connection refused"`):       true,
		fmt.Errorf("reset: %w", status.Error(codes.Unavailable, `connection error: desc = "transport: Error while dialing: dial tcp: lookup w-1: no such host"`)): true,
		status.Error(codes.Unavailable, "error reading from server: EOF"):                                                                                         false,
		status.Error(codes.Unavailable, "simulated fault"):                                                                                                        false,
		status.Error(codes.DeadlineExceeded, "context deadline exceeded"):                                                                                         false,
		status.Error(codes.Internal, "Error while dialing"):                                                                                                       false,
		nil: false,
	} {
		if got := NotSent(err); got != want {
			t.Errorf("NotSent(%v) = %v, want %v", err, got, want)
		}
	}
}

func TestRefused(t *testing.T) {
	for msg, want := range map[error]bool{
		status.Error(codes.Unavailable, `connection error: desc = "error reading server preface: remote error: tls: unknown certificate authority"`):                                               true,
		status.Error(codes.Unavailable, `connection error: desc = "transport: authentication handshake failed: tls: failed to verify certificate: x509: certificate signed by unknown authority"`): true,
		fmt.Errorf("version: %w", status.Error(codes.Unavailable, `connection error: desc = "transport: authentication handshake failed: EOF"`)):                                                   true,
		status.Error(codes.Unavailable, `connection error: desc = "transport: Error while dialing: dial tcp 127.0.0.1:50000: connect: connection refused"`):                                        false,
		status.Error(codes.PermissionDenied, "not authorized"): false,
		nil: false,
	} {
		if got := Refused(msg); got != want {
			t.Errorf("Refused(%v) = %v, want %v", msg, got, want)
		}
	}
}
