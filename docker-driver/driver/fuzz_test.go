package driver

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/ringipam/ringipam/pkg/store/memory"
)

// FuzzRequests sends arbitrary bodies to every IPAM call of the driver's
// handler over one memory store: no request may crash the driver, every
// answer is JSON with either a result or an Err string, and the pool
// invariants hold afterwards.
func FuzzRequests(f *testing.F) {
	seeds := []struct{ path, body string }{
		{pathRequestPool, `{"AddressSpace":"global","Pool":"198.18.60.0/24","SubPool":"","Options":{},"V6":false}`},
		{pathRequestPool, `{"AddressSpace":"global","Pool":"198.18.60.0/24","SubPool":"198.18.60.0/25","Options":{"pool":"p1"}}`},
		{pathRequestPool, `{"AddressSpace":"global","Pool":"","V6":true}`},
		{pathRequestAddress, `{"PoolID":"198.18.60.0-24;198.18.60.0/24;198.18.60.1-198.18.60.254","Address":"","Options":{"RequestAddressType":"com.docker.network.gateway"}}`},
		{pathRequestAddress, `{"PoolID":"198.18.60.0-24;198.18.60.0/24;198.18.60.1-198.18.60.254","Address":"198.18.60.9","Options":{"com.docker.network.endpoint.macaddress":"02:42:c6:12:3c:09"}}`},
		{pathRequestAddress, `{"PoolID":"!iso;198.18.60.0/24;198.18.60.1-198.18.60.254","Options":{"com.docker.network.endpoint.macaddress":"02:42:c6:12:3c:0a"}}`},
		{pathReleaseAddress, `{"PoolID":"198.18.60.0-24;198.18.60.0/24;198.18.60.1-198.18.60.254","Address":"198.18.60.9"}`},
		{pathReleasePool, `{"PoolID":"198.18.60.0-24;198.18.60.0/24;198.18.60.1-198.18.60.254"}`},
		{pathRequestPool, `{"Pool":"::/0","V6":true}`},
		{pathRequestAddress, `{"PoolID":";;-","Options":null}`},
	}
	for _, s := range seeds {
		f.Add(s.path, []byte(s.body))
	}
	f.Fuzz(func(t *testing.T, path string, body []byte) {
		switch path {
		case pathRequestPool, pathReleasePool, pathRequestAddress, pathReleaseAddress:
		default:
			path = pathRequestAddress
		}
		st := memory.New()
		d := newDriver(t, st, "fuzzhost")
		h := Handler(d, NewMetrics(), quiet())
		// Set up one network so address calls have something to hit.
		for _, setup := range seeds[:4] {
			h.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest(http.MethodPost, setup.path, strings.NewReader(setup.body)))
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, path, bytes.NewReader(body)))
		var out map[string]any
		if err := json.Unmarshal(rec.Body.Bytes(), &out); err != nil {
			t.Fatalf("%s %q: answer %q is not JSON: %v", path, body, rec.Body.Bytes(), err)
		}
		if rec.Code != http.StatusOK {
			if e, ok := out["Err"].(string); !ok || e == "" {
				t.Fatalf("%s %q: failure %d without an Err string: %s", path, body, rec.Code, rec.Body.Bytes())
			}
		}
		for _, p := range []string{"198.18.60.0-24", "p1"} {
			if bad, err := d.alloc.Check(t.Context(), p); err == nil && len(bad) > 0 {
				t.Fatalf("%s %q broke pool %s: %v", path, body, p, bad)
			}
		}
	})
}
