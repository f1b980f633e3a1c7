// Command ringipam-uninstall is the preStop hook of the Kubernetes
// DaemonSet's agent container (deploy/kubernetes/ringipam.yaml): it removes
// what the installer wrote on the node (the files listed in its record:
// the CNI list and the binaries it put into /opt/cni/bin), but only when
// the DaemonSet itself is going away, `kubectl delete -f` of the manifest.
//
// A preStop hook runs whenever the pod's container is stopped: on a rolling
// update, a pod deleted by hand, a node drain and a liveness restart too,
// when the node's pods still need the list and the plugins (their DELs)
// and the next agent pod reinstalls them. So the hook asks the apiserver,
// with the pod's service-account token, for its DaemonSet:
//
//	the DaemonSet exists, not being deleted   keep (exit 0)
//	it is being deleted, or is gone (404)      uninstall
//	401 or 403: the manifest's ServiceAccount
//	or Role is gone (deleted with it)          uninstall
//	no answer, any other status                keep, and say why (exit 1)
//
// Unsure means keep: a node that keeps a stale list can be cleaned by hand,
// a node that lost its list while its pods run cannot DEL them.
//
// The apiserver is the in-cluster one (KUBERNETES_SERVICE_HOST and
// KUBERNETES_SERVICE_PORT, the token, CA and namespace under
// /var/run/secrets/kubernetes.io/serviceaccount), the DaemonSet's name is
// --daemonset, the installer's record is --record (one path per line, as
// the container sees it; only paths under --root are removed).
package main

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/ringipam/ringipam/internal/version"
)

// saDir is where kubelet mounts the pod's service-account credentials.
const saDir = "/var/run/secrets/kubernetes.io/serviceaccount"

func main() {
	if version.Requested(os.Args[1:]) {
		fmt.Println(version.Get().Line("ringipam-uninstall"))
		return
	}
	fs := flag.NewFlagSet("ringipam-uninstall", flag.ExitOnError)
	ds := fs.String("daemonset", "ringipam", "the DaemonSet whose deletion uninstalls")
	record := fs.String("record", "/var/lib/ringipam/installed", "the installer's record of the files it wrote")
	root := fs.String("root", "/host/", "only files under this directory are removed")
	timeout := fs.Duration("timeout", 10*time.Second, "bound of the apiserver request")
	fs.Parse(os.Args[1:])

	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	verdict, err := ask(ctx, inCluster{dir: saDir, env: os.Getenv}, *ds)
	if err != nil {
		fmt.Fprintf(os.Stderr, "ringipam-uninstall: keeping the node's CNI files: %v\n", err)
		os.Exit(1)
	}
	if !verdict.uninstall {
		fmt.Printf("ringipam-uninstall: keeping the node's CNI files: %s\n", verdict.why)
		return
	}
	fmt.Printf("ringipam-uninstall: %s: removing what the installer wrote\n", verdict.why)
	removed, err := uninstall(*record, *root)
	for _, p := range removed {
		fmt.Printf("ringipam-uninstall: removed %s\n", p)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "ringipam-uninstall: %v\n", err)
		os.Exit(1)
	}
}

// inCluster is the pod's view of its apiserver.
type inCluster struct {
	dir string                  // the service-account directory
	env func(key string) string // os.Getenv
}

type verdict struct {
	uninstall bool
	why       string
}

// ask asks the apiserver whether DaemonSet name (in the pod's namespace)
// is going away. An error means no usable answer.
func ask(ctx context.Context, c inCluster, name string) (verdict, error) {
	host, port := c.env("KUBERNETES_SERVICE_HOST"), c.env("KUBERNETES_SERVICE_PORT")
	if host == "" || port == "" {
		return verdict{}, errors.New("KUBERNETES_SERVICE_HOST or KUBERNETES_SERVICE_PORT unset")
	}
	token, err := os.ReadFile(filepath.Join(c.dir, "token"))
	if err != nil {
		return verdict{}, fmt.Errorf("service-account token: %w", err)
	}
	ns, err := os.ReadFile(filepath.Join(c.dir, "namespace"))
	if err != nil {
		return verdict{}, fmt.Errorf("service-account namespace: %w", err)
	}
	ca, err := os.ReadFile(filepath.Join(c.dir, "ca.crt"))
	if err != nil {
		return verdict{}, fmt.Errorf("service-account CA: %w", err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(ca) {
		return verdict{}, errors.New("service-account CA: no certificate in ca.crt")
	}
	client := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}}}
	url := fmt.Sprintf("https://%s/apis/apps/v1/namespaces/%s/daemonsets/%s", net.JoinHostPort(host, port), strings.TrimSpace(string(ns)), name)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return verdict{}, err
	}
	req.Header.Set("Authorization", "Bearer "+strings.TrimSpace(string(token)))
	req.Header.Set("Accept", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return verdict{}, fmt.Errorf("asking for DaemonSet %s: %w", name, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 4<<20))
	if err != nil {
		return verdict{}, fmt.Errorf("reading DaemonSet %s: %w", name, err)
	}
	return decide(name, resp.StatusCode, body)
}

// decide maps the apiserver's answer for the DaemonSet to a verdict (see
// the package comment).
func decide(name string, status int, body []byte) (verdict, error) {
	switch status {
	case http.StatusOK:
		var ds struct {
			Metadata struct {
				DeletionTimestamp *time.Time `json:"deletionTimestamp"`
			} `json:"metadata"`
		}
		if err := json.Unmarshal(body, &ds); err != nil {
			return verdict{}, fmt.Errorf("DaemonSet %s: %w", name, err)
		}
		if ds.Metadata.DeletionTimestamp != nil {
			return verdict{true, "DaemonSet " + name + " is being deleted"}, nil
		}
		return verdict{false, "DaemonSet " + name + " stays (a restart or an update)"}, nil
	case http.StatusNotFound:
		return verdict{true, "DaemonSet " + name + " is gone"}, nil
	case http.StatusUnauthorized, http.StatusForbidden:
		return verdict{true, fmt.Sprintf("the apiserver refuses the pod's account (%d): the manifest's ServiceAccount or Role is gone", status)}, nil
	default:
		return verdict{}, fmt.Errorf("DaemonSet %s: apiserver answered %d: %.200s", name, status, body)
	}
}

// uninstall removes every file the record lists that lies under root, then
// the record, and returns what it removed. Files already gone are fine.
func uninstall(record, root string) ([]string, error) {
	f, err := os.Open(record)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil // nothing installed (or uninstalled already)
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	root = filepath.Clean(root) + string(filepath.Separator)
	var removed []string
	var errs []error
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		p := strings.TrimSpace(sc.Text())
		if p == "" {
			continue
		}
		if c := filepath.Clean(p); c != p || !strings.HasPrefix(p, root) {
			errs = append(errs, fmt.Errorf("record %s: %q is not a clean path under %s: left alone", record, p, root))
			continue
		}
		switch err := os.Remove(p); {
		case err == nil:
			removed = append(removed, p)
		case !errors.Is(err, os.ErrNotExist):
			errs = append(errs, err)
		}
	}
	if err := sc.Err(); err != nil {
		errs = append(errs, fmt.Errorf("record %s: %w", record, err))
	}
	if len(errs) == 0 {
		if err := os.Remove(record); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return removed, errors.Join(errs...)
}
