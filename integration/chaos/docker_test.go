//go:build integration

package chaos

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/docker/go-plugins-helpers/ipam"

	"github.com/ringipam/ringipam/docker-driver/driver"
)

// dockerClient speaks the libnetwork remote IPAM protocol to the driver's
// unix socket, as dockerd does, without a dockerd. It counts requests in
// flight so that the fault injector can restart the driver mid-request.
type dockerClient struct {
	hc       *http.Client
	inFlight atomic.Int64
}

// dockerRequestTimeout bounds one request (the driver's own deadline is 6s).
const dockerRequestTimeout = 15 * time.Second

func newDockerClient(sock string) *dockerClient {
	return &dockerClient{hc: &http.Client{Timeout: dockerRequestTimeout, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", sock)
		},
		// A new connection per request, as after a driver restart anyway.
		DisableKeepAlives: true,
	}}}
}

// errDriver is an error the driver answered (its Err field).
type errDriver struct{ msg string }

func (e errDriver) Error() string { return e.msg }

// post sends one request; a transport failure comes back as is, an error
// the driver answered as errDriver.
func (d *dockerClient) post(method string, req, resp any) error {
	d.inFlight.Add(1)
	defer d.inFlight.Add(-1)
	b, err := json.Marshal(req)
	if err != nil {
		return err
	}
	r, err := d.hc.Post("http://driver/IpamDriver."+method, "application/json", bytes.NewReader(b))
	if err != nil {
		return err
	}
	defer r.Body.Close()
	body, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
	if err != nil {
		return err
	}
	var e struct{ Err string }
	if json.Unmarshal(body, &e) == nil && e.Err != "" {
		return errDriver{e.Err}
	}
	if r.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s: %s", method, r.Status, body)
	}
	if resp == nil {
		return nil
	}
	return json.Unmarshal(body, resp)
}

// network asks for the shared pool as `docker network create --ipam-driver
// ... --ipam-opt pool=<pool> --subnet <subnet>` does: RequestPool, then
// the gateway. It returns the PoolID.
func (d *dockerClient) network(poolName string, subnet netip.Prefix) (string, error) {
	var pr ipam.RequestPoolResponse
	if err := d.post("RequestPool", ipam.RequestPoolRequest{AddressSpace: driver.GlobalAddressSpace, Pool: subnet.String(),
		Options: map[string]string{driver.OptPool: poolName}}, &pr); err != nil {
		return "", fmt.Errorf("RequestPool: %w", err)
	}
	var ar ipam.RequestAddressResponse
	if err := d.post("RequestAddress", ipam.RequestAddressRequest{PoolID: pr.PoolID,
		Options: map[string]string{driver.OptAddressType: driver.AddressTypeGateway}}, &ar); err != nil {
		return "", fmt.Errorf("gateway: %w", err)
	}
	return pr.PoolID, nil
}

// dockerWorkers drive the driver like containers coming and going on a
// Docker host: each keeps at most one endpoint, requesting an address for
// a new MAC, asking again for the same MAC now and then (a replay, which
// must return the same address), and releasing it.
type dockerWorkers struct {
	c        *dockerClient
	poolID   string
	record   func(call)
	stopping atomic.Bool
	wg       sync.WaitGroup
	mu       sync.Mutex
	live     map[string]netip.Addr // MAC -> address
	host     string
}

func (w *dockerWorkers) start(n int, seed uint64) {
	w.live = map[string]netip.Addr{}
	for i := range n {
		w.wg.Go(func() { w.work(i, seed) })
	}
}

func (w *dockerWorkers) stop() map[string]netip.Addr {
	w.stopping.Store(true)
	w.wg.Wait()
	return w.live
}

func (w *dockerWorkers) work(i int, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, uint64(1000+i)))
	client := 1000 + i
	n := 0
	var mac string
	var addr netip.Addr
	for !w.stopping.Load() {
		if mac == "" {
			n++
			m := fmt.Sprintf("02:42:c6:%02x:%02x:%02x", i, n>>8&0xff, n&0xff)
			if got, ok := w.request(client, m); ok {
				mac, addr = m, got
				w.setLive(mac, addr)
			}
			continue
		}
		if rng.Float64() < 0.25 {
			w.request(client, mac)
			continue
		}
		w.release(client, mac, addr)
		w.setLive(mac, netip.Addr{})
		mac = ""
	}
}

func (w *dockerWorkers) setLive(mac string, a netip.Addr) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if a.IsValid() {
		w.live[mac] = a
	} else {
		delete(w.live, mac)
	}
}

// request asks for mac's address until the answer is definite (a bounded
// number of times): after an ambiguous answer the endpoint may hold an
// address, and asking again with the same MAC returns it (a replay).
func (w *dockerWorkers) request(client int, mac string) (netip.Addr, bool) {
	for i := range 10 {
		c := w.do(client, verbAdd, mac, netip.Addr{})
		switch c.Outcome {
		case outOK:
			return c.Addr, true
		case outFailed:
			return netip.Addr{}, false
		}
		time.Sleep(time.Duration(i+1) * 100 * time.Millisecond)
	}
	return netip.Addr{}, false
}

// release gives mac's address a back until the driver says it did
// (bounded). A release whose outcome is unknown is never simply sent again:
// ReleaseAddress names an address, not the endpoint, and by then the
// address may be another endpoint's. The worker first asks for the MAC's
// address again (a replay, answered definitely: the address it still
// holds, or a new one if the release took effect) and releases that.
func (w *dockerWorkers) release(client int, mac string, a netip.Addr) {
	for i := range 10 {
		if w.do(client, verbRelease, mac, a).Outcome == outOK {
			return
		}
		time.Sleep(time.Duration(i+1) * 100 * time.Millisecond)
		got, ok := w.request(client, mac)
		if !ok {
			return // it holds nothing (or the driver never answered: a leak the checks report)
		}
		a = got
	}
}

// do makes one call and records it. A transport failure is ambiguous (the
// driver may have died after committing), as is "try again later"; any
// other error the driver answers is definite.
func (w *dockerWorkers) do(client int, verb, mac string, a netip.Addr) call {
	c := call{Client: client, Host: w.host, Verb: verb, Owner: "docker/" + mac}
	var err error
	c.Call = monotonic()
	if verb == verbAdd {
		var r ipam.RequestAddressResponse
		err = w.c.post("RequestAddress", ipam.RequestAddressRequest{PoolID: w.poolID,
			Options: map[string]string{driver.OptMAC: mac}}, &r)
		if err == nil {
			p, perr := netip.ParsePrefix(r.Address)
			if perr != nil {
				err = fmt.Errorf("address %q: %w", r.Address, perr)
			}
			c.Addr = p.Addr()
		}
	} else {
		c.Addr = a
		err = w.c.post("ReleaseAddress", ipam.ReleaseAddressRequest{PoolID: w.poolID, Address: a.String()}, nil)
	}
	c.Return = monotonic()
	switch e, isDriver := err.(errDriver); {
	case err == nil:
		c.Outcome = outOK
	case isDriver && strings.Contains(e.msg, "try again later"):
		c.Outcome, c.Code, c.Msg = outAmbiguous, 11, e.msg
	case isDriver:
		c.Outcome, c.Msg = outFailed, e.msg
		if strings.Contains(e.msg, "no free address") || strings.Contains(e.msg, "not enough capacity") {
			c.Code = 102
		} else {
			c.Unclear = "driver error: " + e.msg
		}
	default:
		c.Outcome, c.Msg = outAmbiguous, "transport: "+err.Error()
	}
	w.record(c)
	return c
}
