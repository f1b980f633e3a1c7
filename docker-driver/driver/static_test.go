package driver

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ringipam/ringipam/pkg/store/local"
)

// TestStaticOutsideIPRange (issue 33, seed 001) drives the HTTP handler on
// the local store: with --ip-range 198.18.73.8/30 inside --subnet
// 198.18.73.0/24, dynamic requests get only the range's four addresses
// (then the capacity error), while --ip outside the range but inside the
// subnet succeeds.
func TestStaticOutsideIPRange(t *testing.T) {
	st, err := local.New(local.Config{Path: filepath.Join(t.TempDir(), "store.db"), OpenTimeout: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	m := NewMetrics()
	d := newDriver(t, st, "h1")
	srv := httptest.NewServer(Handler(d, m, quiet()))
	t.Cleanup(srv.Close)
	c := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{}}
	post := func(path string, body any) (int, map[string]any) {
		t.Helper()
		return callURL(t, c, srv.URL+path, body)
	}
	code, got := post(pathRequestPool, map[string]any{"AddressSpace": LocalAddressSpace, "Pool": "198.18.73.0/24", "SubPool": "198.18.73.8/30", "Options": map[string]string{}})
	if code != 200 {
		t.Fatalf("request pool: %d %v", code, got)
	}
	pid := got["PoolID"].(string)
	if code, got = post(pathRequestAddress, map[string]any{"PoolID": pid, "Options": map[string]string{OptAddressType: AddressTypeGateway}}); code != 200 || got["Address"] != "198.18.73.1/24" {
		t.Fatalf("gateway: %d %v", code, got)
	}
	for i := range 4 {
		code, got = post(pathRequestAddress, map[string]any{"PoolID": pid, "Options": map[string]string{OptMAC: mac(i)}})
		a, _ := got["Address"].(string)
		p, err := netip.ParsePrefix(a)
		if code != 200 || err != nil || !netip.MustParsePrefix("198.18.73.8/30").Contains(p.Addr()) {
			t.Fatalf("dynamic %d: %d %v, want an address of 198.18.73.8-11", i, code, got)
		}
	}
	code, got = post(pathRequestAddress, map[string]any{"PoolID": pid, "Options": map[string]string{OptMAC: mac(9)}})
	if msg, _ := got["Err"].(string); code != 500 || !strings.Contains(msg, "no free address") {
		t.Fatalf("dynamic with the --ip-range full: %d %v, want the capacity error", code, got)
	}
	for _, ip := range []string{"198.18.73.200", "198.18.73.2"} {
		code, got = post(pathRequestAddress, map[string]any{"PoolID": pid, "Address": ip, "Options": map[string]string{OptMAC: mac(int(ip[len(ip)-1]))}})
		if code != 200 || got["Address"] != ip+"/24" {
			t.Fatalf("--ip %s outside --ip-range, inside --subnet: %d %v", ip, code, got)
		}
	}
	// The network's pool asked again (dockerd's replay) still conforms.
	if code, got = post(pathRequestPool, map[string]any{"AddressSpace": LocalAddressSpace, "Pool": "198.18.73.0/24", "SubPool": "198.18.73.8/30", "Options": map[string]string{}}); code != 200 || got["PoolID"] != pid {
		t.Fatalf("request pool again: %d %v, want %s", code, got, pid)
	}
}

// callURL posts body to url as dockerd does and decodes the answer.
func callURL(t *testing.T, c *http.Client, url string, body any) (int, map[string]any) {
	t.Helper()
	b, _ := json.Marshal(body)
	res, err := c.Post(url, "application/vnd.docker.plugins.v1.2+json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	raw, _ := io.ReadAll(res.Body)
	out := map[string]any{}
	if err := json.Unmarshal(raw, &out); err != nil {
		t.Fatalf("%s: response %q: %v", url, raw, err)
	}
	return res.StatusCode, out
}
