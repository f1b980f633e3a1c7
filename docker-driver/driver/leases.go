package driver

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math/big"
	"net/netip"
	"strconv"
	"strings"
	"time"

	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/store"
)

// DefaultPool is a base prefix carved into subnets of Size bits for
// networks created without --subnet, like dockerd's default-address-pools.
type DefaultPool struct {
	Base netip.Prefix `json:"base"`
	Size int          `json:"size"`
}

func (p DefaultPool) validate() error {
	if !p.Base.IsValid() || p.Base != p.Base.Masked() {
		return fmt.Errorf("%w: default pool base %v must be a masked CIDR", pool.ErrInvalid, p.Base)
	}
	if p.Size < p.Base.Bits() || p.Size > p.Base.Addr().BitLen() {
		return fmt.Errorf("%w: default pool %s: size /%d must lie between /%d and /%d", pool.ErrInvalid, p.Base, p.Size, p.Base.Bits(), p.Base.Addr().BitLen())
	}
	if _, _, ok := pool.UsableBounds(netip.PrefixFrom(p.Base.Addr(), p.Size)); !ok {
		return fmt.Errorf("%w: default pool %s: /%d subnets hold no usable address", pool.ErrInvalid, p.Base, p.Size)
	}
	return nil
}

// String renders the pool as dockerd writes default-address-pools:
// "base=198.18.0.0/16,size=24".
func (p DefaultPool) String() string { return fmt.Sprintf("base=%s,size=%d", p.Base, p.Size) }

// ParseDefaultPool parses "base=198.18.0.0/16,size=24".
func ParseDefaultPool(s string) (DefaultPool, error) {
	var p DefaultPool
	var haveBase, haveSize bool
	for _, kv := range strings.Split(s, ",") {
		k, v, _ := strings.Cut(strings.TrimSpace(kv), "=")
		switch k {
		case "base":
			b, err := netip.ParsePrefix(v)
			if err != nil {
				return DefaultPool{}, fmt.Errorf("%w: default pool %q: base: %v", pool.ErrInvalid, s, err)
			}
			p.Base, haveBase = b, true
		case "size":
			n, err := strconv.Atoi(v)
			if err != nil {
				return DefaultPool{}, fmt.Errorf("%w: default pool %q: size: %v", pool.ErrInvalid, s, err)
			}
			p.Size, haveSize = n, true
		default:
			return DefaultPool{}, fmt.Errorf("%w: default pool %q: unknown key %q (want base=CIDR,size=BITS)", pool.ErrInvalid, s, k)
		}
	}
	if !haveBase || !haveSize {
		return DefaultPool{}, fmt.Errorf("%w: default pool %q: want base=CIDR,size=BITS", pool.ErrInvalid, s)
	}
	return p, p.validate()
}

// nth returns the n-th subnet of the pool, or false past the end.
func (p DefaultPool) nth(n uint64) (netip.Prefix, bool) {
	if bits := p.Size - p.Base.Bits(); bits < 64 && n >= 1<<bits {
		return netip.Prefix{}, false
	}
	b := p.Base.Addr().AsSlice()
	v := new(big.Int).SetBytes(b)
	v.Add(v, new(big.Int).Lsh(new(big.Int).SetUint64(n), uint(p.Base.Addr().BitLen()-p.Size)))
	out := v.FillBytes(make([]byte, len(b)))
	a, _ := netip.AddrFromSlice(out)
	if !p.Base.Contains(a) {
		return netip.Prefix{}, false
	}
	return netip.PrefixFrom(a, p.Size), true
}

// leaseRecord is the value of a lease key.
type leaseRecord struct {
	Subnet  netip.Prefix `json:"subnet"`
	Pool    string       `json:"pool"`
	Created time.Time    `json:"created"`
}

func leasePrefix(host string) string { return "docker/lease/" + host + "/" }

func leaseKey(host string, pid poolID) string {
	return leasePrefix(host) + pid.Pool + "/" + pid.Lease
}

// leaseDefault leases the first subnet of the default pools of the family
// that this host holds no lease on.
func (d *Driver) leaseDefault(ctx context.Context, v6 bool, skip map[netip.Prefix]bool) (poolID, error) {
	select {
	case d.pick <- struct{}{}:
		defer func() { <-d.pick }()
	case <-ctx.Done():
		return poolID{}, fmt.Errorf("waiting to pick a default pool: %w", ctx.Err())
	}
	kvs, err := d.st.Scan(ctx, leasePrefix(d.host), store.PrefixEnd(leasePrefix(d.host)), 0)
	if err != nil {
		return poolID{}, fmt.Errorf("read default pool leases: %w", err)
	}
	leased := map[netip.Prefix]bool{}
	for _, kv := range kvs {
		var r leaseRecord
		if err := json.Unmarshal(kv.Value, &r); err != nil {
			return poolID{}, fmt.Errorf("lease %s is corrupt: %w", kv.Key, err)
		}
		leased[r.Subnet] = true
	}
	for p := range skip {
		leased[p] = true
	}
	tried := 0
	for _, p := range d.pools {
		if p.Base.Addr().Is6() != v6 {
			continue
		}
		// Only the first len(leased)+1 subnets can hold a free one.
		for n := uint64(0); n <= uint64(len(leased)); n++ {
			sub, ok := p.nth(n)
			if !ok {
				break
			}
			tried++
			if leased[sub] {
				continue
			}
			start, end, err := shape(sub, "")
			if err != nil {
				return poolID{}, err
			}
			pid := poolID{Pool: PoolName(sub), Subnet: sub, Start: start, End: end, Lease: newToken()}
			rec, err := json.Marshal(leaseRecord{Subnet: sub, Pool: pid.Pool, Created: time.Now().UTC()})
			if err != nil {
				return poolID{}, err
			}
			key := leaseKey(d.host, pid)
			if err := d.st.Commit(ctx, []store.Cond{{Key: key}}, []store.Op{store.Put(key, rec)}); err != nil {
				return poolID{}, fmt.Errorf("lease default pool %s: %w", sub, err)
			}
			return pid, nil
		}
	}
	family := "IPv4"
	if v6 {
		family = "IPv6"
	}
	if tried == 0 {
		return poolID{}, fmt.Errorf("%w: no default %s pool is configured; pass --subnet", pool.ErrNoCapacity, family)
	}
	return poolID{}, fmt.Errorf("%w: every default %s pool subnet is leased by this host or taken by another pool definition (%d); pass --subnet or add default pools", pool.ErrNoCapacity, family, len(leased))
}

// dropLease undoes a lease taken by a RequestPool that then failed.
func (d *Driver) dropLease(ctx context.Context, pid poolID) {
	if pid.Lease == "" {
		return
	}
	if err := d.st.Commit(ctx, nil, []store.Op{store.Delete(leaseKey(d.host, pid))}); err != nil {
		d.log.Warn("could not drop default pool lease", "subnet", pid.Subnet, "err", err)
	}
}

func newToken() string {
	var b [8]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails on Linux
	return hex.EncodeToString(b[:])
}
