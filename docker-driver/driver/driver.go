package driver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"strings"
	"time"

	"github.com/docker/go-plugins-helpers/ipam"

	"github.com/ringipam/ringipam/pkg/names"
	"github.com/ringipam/ringipam/pkg/pool"
	"github.com/ringipam/ringipam/pkg/store"
)

// Option names and values of the remote IPAM protocol that the driver reads.
const (
	// OptIsolated (--ipam-opt isolated=true) records the pool as an
	// address space of its own: it may overlap other pools (a truly
	// separate L2 segment). Without it an overlapping pool is refused.
	OptIsolated = "isolated"
	// OptPool is the --ipam-opt that names the ringipam pool explicitly.
	OptPool = "pool"
	// OptMAC carries the endpoint's MAC address (RequiresMACAddress).
	OptMAC = "com.docker.network.endpoint.macaddress"
	// OptAddressType says what an address is requested for.
	OptAddressType = "RequestAddressType"
	// AddressTypeGateway is OptAddressType's value for the network gateway.
	AddressTypeGateway = "com.docker.network.gateway"
)

// Address spaces the driver reports; pools are cluster-wide whatever the
// space, so the driver ignores the space of later requests.
const (
	LocalAddressSpace  = "ringipam-local"
	GlobalAddressSpace = "ringipam-global"
)

// DefaultTimeout bounds one driver call when Options.Timeout is zero.
const DefaultTimeout = 15 * time.Second

// Capabilities is the driver's answer to GetCapabilities. The helper
// library's CapabilitiesResponse lacks RequiresRequestReplay, hence this type.
type Capabilities struct {
	RequiresMACAddress    bool
	RequiresRequestReplay bool
}

// Options configures a Driver.
type Options struct {
	// DefaultPools are carved into subnets for networks created without
	// --subnet; IPv4 and IPv6 entries may be mixed.
	DefaultPools []DefaultPool
	// Timeout bounds each call (DefaultTimeout if zero).
	Timeout time.Duration
	// Metrics, if not nil, counts allocations and releases.
	Metrics *Metrics
	// Logger receives one line per state change; slog.Default() if nil.
	Logger *slog.Logger
}

// Driver serves the IPAM calls for one host. Create it with New.
type Driver struct {
	alloc   *pool.Allocator
	st      store.Store
	host    string
	pools   []DefaultPool
	timeout time.Duration
	m       *Metrics
	log     *slog.Logger
	// pick serialises default-pool leasing in this process, so that two
	// concurrent RequestPool calls never lease the same subnet.
	pick chan struct{}
}

// New returns a Driver allocating for alloc's host on alloc's store.
func New(alloc *pool.Allocator, opts Options) (*Driver, error) {
	for _, p := range opts.DefaultPools {
		if err := p.validate(); err != nil {
			return nil, err
		}
	}
	if opts.Timeout < 0 {
		return nil, fmt.Errorf("%w: negative timeout %s", pool.ErrInvalid, opts.Timeout)
	}
	if opts.Timeout == 0 {
		opts.Timeout = DefaultTimeout
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	return &Driver{
		alloc:   alloc,
		st:      alloc.Store(),
		host:    alloc.Host(),
		pools:   opts.DefaultPools,
		timeout: opts.Timeout,
		m:       opts.Metrics,
		log:     opts.Logger,
		pick:    make(chan struct{}, 1),
	}, nil
}

// Host returns the host name the driver allocates for.
func (d *Driver) Host() string { return d.host }

func (d *Driver) ctx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, d.timeout)
}

// Capabilities reports that dockerd must send endpoint MACs and replay its
// pool and address requests when it starts.
func (d *Driver) Capabilities() Capabilities {
	return Capabilities{RequiresMACAddress: true, RequiresRequestReplay: true}
}

// AddressSpaces reports the driver's (nominal) address spaces.
func (d *Driver) AddressSpaces() *ipam.AddressSpacesResponse {
	return &ipam.AddressSpacesResponse{LocalDefaultAddressSpace: LocalAddressSpace, GlobalDefaultAddressSpace: GlobalAddressSpace}
}

// RequestPool resolves the network's pool (see the package doc).
func (d *Driver) RequestPool(ctx context.Context, req *ipam.RequestPoolRequest) (*ipam.RequestPoolResponse, error) {
	ctx, cancel := d.ctx(ctx)
	defer cancel()
	name := req.Options[OptPool]
	if name != "" {
		if err := names.Pool(name); err != nil {
			return nil, fmt.Errorf("%w: --ipam-opt %s: %w", pool.ErrInvalid, OptPool, err)
		}
	}
	if req.Pool == "" {
		if req.SubPool != "" {
			return nil, fmt.Errorf("%w: --ip-range needs --subnet", pool.ErrInvalid)
		}
		if name != "" {
			return nil, fmt.Errorf("%w: --ipam-opt pool=%s needs --subnet (the subnet recorded for the pool)", pool.ErrInvalid, name)
		}
		return d.requestDefault(ctx, req.V6)
	}
	subnet, err := netip.ParsePrefix(req.Pool)
	if err != nil {
		return nil, fmt.Errorf("%w: subnet %q: %v", pool.ErrInvalid, req.Pool, err)
	}
	if subnet != subnet.Masked() {
		return nil, fmt.Errorf("%w: subnet %s has host bits set (did you mean %s?)", pool.ErrInvalid, subnet, subnet.Masked())
	}
	if subnet.Addr().Is6() != req.V6 {
		return nil, fmt.Errorf("%w: subnet %s is not of the requested address family (IPv6=%v)", pool.ErrInvalid, subnet, req.V6)
	}
	isolated, err := boolOpt(req.Options, OptIsolated)
	if err != nil {
		return nil, err
	}
	pid := poolID{Pool: name, Subnet: subnet, Isolated: isolated}
	if pid.Pool == "" {
		pid.Pool = PoolName(subnet)
	}
	if pid.Start, pid.End, err = shape(subnet, req.SubPool); err != nil {
		return nil, err
	}
	def, err := d.alloc.Definition(ctx, pid.Pool)
	switch {
	case errors.Is(err, pool.ErrUnknownPool):
		// Recorded by the gateway request, which knows --gateway.
	case err != nil:
		return nil, err
	default:
		if pid, err = conform(pid, def, req.SubPool != ""); err != nil {
			return nil, err
		}
	}
	return &ipam.RequestPoolResponse{PoolID: pid.String(), Pool: pid.Subnet.String()}, nil
}

// requestDefault leases a default-pool subnet whose pool, if recorded,
// fits it (a subnet whose name another pool definition took is skipped).
func (d *Driver) requestDefault(ctx context.Context, v6 bool) (*ipam.RequestPoolResponse, error) {
	skip := map[netip.Prefix]bool{}
	for {
		pid, err := d.leaseDefault(ctx, v6, skip)
		if err != nil {
			return nil, err
		}
		def, err := d.alloc.Definition(ctx, pid.Pool)
		if err == nil {
			var cerr error
			if pid, cerr = conform(pid, def, false); cerr != nil {
				d.log.Warn("default pool subnet skipped: its pool is recorded otherwise", "subnet", pid.Subnet, "err", cerr)
				d.dropLease(ctx, pid)
				skip[pid.Subnet] = true
				continue
			}
		} else if !errors.Is(err, pool.ErrUnknownPool) {
			d.dropLease(ctx, pid)
			return nil, err
		}
		d.log.Info("leased default pool", "pool", pid.Pool, "subnet", pid.Subnet, "lease", pid.Lease)
		return &ipam.RequestPoolResponse{PoolID: pid.String(), Pool: pid.Subnet.String()}, nil
	}
}

// conform checks a recorded definition against what dockerd asked for and
// adopts its range when dockerd gave no --ip-range. A Docker network's pool
// has one subnet: one dynamic range (--ip-range, or the whole subnet) and,
// around it, the static-only ranges of the rest of the subnet (see
// dockerRanges); a pool recorded before static-only ranges existed has the
// dynamic range alone, and is accepted as it is.
func conform(pid poolID, def pool.Def, rangeGiven bool) (poolID, error) {
	dyn, ok := dynamicRange(def, pid.Subnet)
	if !ok {
		var subnets []string
		for _, r := range def.Ranges {
			subnets = append(subnets, r.Subnet.String())
		}
		return pid, fmt.Errorf("%w: pool %s is recorded with subnet(s) %v; a Docker network needs a pool of exactly one subnet, %s", pool.ErrDefinitionMismatch, def.Name, subnets, pid.Subnet)
	}
	if rangeGiven && (dyn.Start != pid.Start || dyn.End != pid.End) {
		return pid, fmt.Errorf("%w: pool %s is recorded with range %s-%s; --ip-range gives %s-%s", pool.ErrDefinitionMismatch, def.Name, dyn.Start, dyn.End, pid.Start, pid.End)
	}
	pid.Start, pid.End = dyn.Start, dyn.End
	return pid, nil
}

// dynamicRange returns the one range of def that is not static-only, when
// every range of def lies in subnet.
func dynamicRange(def pool.Def, subnet netip.Prefix) (pool.Range, bool) {
	var dyn []pool.Range
	for _, r := range def.Ranges {
		if r.Subnet != subnet {
			return pool.Range{}, false
		}
		if !r.Static {
			dyn = append(dyn, r)
		}
	}
	if len(dyn) != 1 {
		return pool.Range{}, false
	}
	return dyn[0], true
}

// dockerRanges are the ranges the driver records for a network: the
// dynamic range [pid.Start, pid.End] and, when --ip-range leaves part of
// the subnet out, that part as static-only ranges, which only a static
// request (docker run --ip) gets. Every range carries the gateway, so
// whichever range a reader finds an address in names it.
func dockerRanges(pid poolID, gw netip.Addr) []pool.Range {
	first, last, _ := pool.UsableBounds(pid.Subnet)
	var out []pool.Range
	if first.Compare(pid.Start) < 0 {
		out = append(out, pool.Range{Subnet: pid.Subnet, Start: first, End: pid.Start.Prev(), Gateway: gw, Static: true})
	}
	out = append(out, pool.Range{Subnet: pid.Subnet, Start: pid.Start, End: pid.End, Gateway: gw})
	if pid.End.Compare(last) < 0 {
		out = append(out, pool.Range{Subnet: pid.Subnet, Start: pid.End.Next(), End: last, Gateway: gw, Static: true})
	}
	return out
}

// ReleasePool drops the default-pool lease the PoolID carries, if any.
// Pools given by --subnet hold nothing per network: their definition stays
// recorded for the other hosts and the CNI plugin.
func (d *Driver) ReleasePool(ctx context.Context, req *ipam.ReleasePoolRequest) error {
	ctx, cancel := d.ctx(ctx)
	defer cancel()
	pid, err := parsePoolID(req.PoolID)
	if err != nil {
		return err
	}
	if pid.Lease == "" {
		return nil
	}
	if err := d.st.Commit(ctx, nil, []store.Op{store.Delete(leaseKey(d.host, pid))}); err != nil {
		return fmt.Errorf("release lease of default pool %s: %w", pid.Subnet, err)
	}
	d.log.Info("released default pool lease", "pool", pid.Pool, "subnet", pid.Subnet, "lease", pid.Lease)
	return nil
}

// RequestAddress hands out the network gateway, an aux address or a
// container address (see the package doc).
func (d *Driver) RequestAddress(ctx context.Context, req *ipam.RequestAddressRequest) (*ipam.RequestAddressResponse, error) {
	ctx, cancel := d.ctx(ctx)
	defer cancel()
	pid, err := parsePoolID(req.PoolID)
	if err != nil {
		return nil, err
	}
	var want netip.Addr
	if req.Address != "" {
		if want, err = netip.ParseAddr(req.Address); err != nil {
			return nil, fmt.Errorf("%w: address %q: %v", pool.ErrInvalid, req.Address, err)
		}
		if !pid.Subnet.Contains(want) {
			return nil, fmt.Errorf("%w: address %s is outside the network's subnet %s", pool.ErrInvalid, want, pid.Subnet)
		}
	}
	var got netip.Addr
	switch {
	case req.Options[OptAddressType] == AddressTypeGateway:
		got, err = d.gateway(ctx, pid, want)
	case req.Options[OptMAC] != "":
		got, err = d.container(ctx, pid, req.Options[OptMAC], want)
	case want.IsValid():
		got, err = d.aux(ctx, pid, want)
	default:
		err = fmt.Errorf("%w: request carries neither an endpoint MAC address nor an address; is this dockerd honouring RequiresMACAddress?", pool.ErrInvalid)
	}
	if err != nil {
		return nil, err
	}
	return &ipam.RequestAddressResponse{Address: netip.PrefixFrom(got, pid.Subnet.Bits()).String()}, nil
}

// gateway records the pool on first use and returns its gateway.
func (d *Driver) gateway(ctx context.Context, pid poolID, want netip.Addr) (netip.Addr, error) {
	def, err := d.alloc.Definition(ctx, pid.Pool)
	if errors.Is(err, pool.ErrUnknownPool) {
		gw := want
		if !gw.IsValid() {
			var ok bool
			if gw, ok = pool.DefaultGateway(pid.Subnet); !ok {
				return netip.Addr{}, fmt.Errorf("%w: subnet %s is a point-to-point link with no default gateway (the same rule as the CNI plugin); give --gateway", pool.ErrInvalid, pid.Subnet)
			}
		}
		nd := pool.Def{Name: pid.Pool, Isolated: pid.Isolated, Ranges: dockerRanges(pid, gw)}
		err = d.alloc.Define(ctx, nd)
		if err == nil {
			d.log.Info("recorded pool", "pool", pid.Pool, "subnet", pid.Subnet, "range", fmt.Sprintf("%s-%s", pid.Start, pid.End), "gateway", gw)
			return gw, nil
		}
		var overlap *pool.OverlapError
		if !errors.Is(err, pool.ErrDefinitionMismatch) || errors.As(err, &overlap) {
			return netip.Addr{}, err
		}
		// Another host recorded it meanwhile: check against that.
		def, err = d.alloc.Definition(ctx, pid.Pool)
	}
	if err != nil {
		return netip.Addr{}, err
	}
	if _, err := conform(pid, def, true); err != nil {
		return netip.Addr{}, err
	}
	dyn, _ := dynamicRange(def, pid.Subnet)
	gw := dyn.Gateway
	if !gw.IsValid() {
		return netip.Addr{}, fmt.Errorf("%w: pool %s is recorded without a gateway; a Docker network needs one (record the pool with a gateway)", pool.ErrDefinitionMismatch, pid.Pool)
	}
	if want.IsValid() && want != gw {
		return netip.Addr{}, fmt.Errorf("%w: pool %s is recorded with gateway %s; --gateway %s differs", pool.ErrDefinitionMismatch, pid.Pool, gw, want)
	}
	return gw, nil
}

// Owner is the owner of the address of the endpoint with MAC mac. The
// allocation records the host; an endpoint with the same MAC on a second
// host is refused with "already exists" (a MAC is unique on a segment).
func Owner(poolName, mac string) (pool.Owner, error) {
	hw, err := names.MAC(mac)
	if err != nil {
		return pool.Owner{}, fmt.Errorf("%w: %w", pool.ErrInvalid, err)
	}
	return pool.Owner{Kind: pool.KindDocker, Network: poolName, ContainerID: hw}, nil
}

// container allocates (or returns, for a replay) the endpoint's address.
func (d *Driver) container(ctx context.Context, pid poolID, mac string, want netip.Addr) (netip.Addr, error) {
	owner, err := Owner(pid.Pool, mac)
	if err != nil {
		return netip.Addr{}, err
	}
	start := time.Now()
	al, err := d.alloc.Allocate(ctx, pool.Request{Owner: owner, Wants: []pool.Want{{Pool: pid.Pool, Role: pool.RoleIP, Addr: want}}})
	if errors.Is(err, pool.ErrUnknownPool) {
		return netip.Addr{}, fmt.Errorf("pool %s is not recorded yet (the network's gateway request records it): %w", pid.Pool, err)
	}
	if err != nil {
		return netip.Addr{}, err
	}
	if al.Host != d.host {
		// An endpoint MAC reused on a second host: never serve it the
		// first host's address.
		return netip.Addr{}, &pool.ExistsError{Owner: owner.String(), Holds: []netip.Addr{al.Addrs[0].Addr}, Host: al.Host}
	}
	got, ok := al.Addr(pid.Pool, pool.RoleIP)
	if !ok || !pid.Subnet.Contains(got) {
		return netip.Addr{}, fmt.Errorf("owner %s holds %v, nothing in subnet %s", owner, al.Addrs, pid.Subnet)
	}
	d.m.allocated(pid.Subnet.Addr().Is4())
	d.log.Info("allocated", "pool", pid.Pool, "owner", owner.String(), "addr", got, "took", time.Since(start))
	return got, nil
}

// auxOwner is the cluster-wide owner of a reserved --aux-address.
func auxOwner(poolName string, a netip.Addr) pool.Owner {
	return pool.Owner{Kind: pool.KindDocker, Network: poolName, ContainerID: "aux-" + a.String()}
}

// aux reserves an --aux-address cluster-wide for this host's network, if
// the pool could hand it out: one shared owner whose holders are the hosts
// reserving it (pool.Allocator.Share).
func (d *Driver) aux(ctx context.Context, pid poolID, a netip.Addr) (netip.Addr, error) {
	def, err := d.alloc.Definition(ctx, pid.Pool)
	if err != nil {
		return netip.Addr{}, err
	}
	if !def.Contains(a) {
		return a, nil // outside the allocatable range, or the gateway: never handed out anyway
	}
	o := auxOwner(pid.Pool, a)
	adopt, markers, err := d.legacyAux(ctx, pid, a)
	if err != nil {
		return netip.Addr{}, err
	}
	if _, err := d.alloc.Share(ctx, o, pool.Want{Pool: pid.Pool, Role: pool.RoleIP, Addr: a}, adopt...); err != nil {
		return netip.Addr{}, fmt.Errorf("reserve aux address: %w", err)
	}
	d.dropMarkers(ctx, markers)
	d.log.Info("reserved aux address", "pool", pid.Pool, "addr", a)
	return a, nil
}

// legacyAux reads the per-host markers (docker/aux/<pool>/<addr>/<host>)
// with which drivers before shared owners recorded who reserves an aux
// address: their hosts are to be adopted as holders, then the markers go.
// A store without markers costs one scan that finds nothing.
func (d *Driver) legacyAux(ctx context.Context, pid poolID, a netip.Addr) (hosts, keys []string, err error) {
	prefix := auxPrefix(pid.Pool, a)
	kvs, err := d.st.Scan(ctx, prefix, store.PrefixEnd(prefix), 0)
	if err != nil {
		return nil, nil, fmt.Errorf("aux address %s: %w", a, err)
	}
	for _, kv := range kvs {
		hosts = append(hosts, strings.TrimPrefix(kv.Key, prefix))
		keys = append(keys, kv.Key)
	}
	return hosts, keys, nil
}

// dropMarkers deletes adopted legacy markers; best effort (a marker left
// behind is adopted again, which changes nothing).
func (d *Driver) dropMarkers(ctx context.Context, keys []string) {
	if len(keys) == 0 {
		return
	}
	var ops []store.Op
	for _, k := range keys {
		ops = append(ops, store.Delete(k))
	}
	if err := d.st.Commit(ctx, nil, ops); err != nil {
		d.log.Warn("dropping adopted aux markers", "err", err)
	}
}

// ReleaseAddress releases a container address or this host's hold on an aux
// address; the gateway and unknown addresses are left alone.
func (d *Driver) ReleaseAddress(ctx context.Context, req *ipam.ReleaseAddressRequest) error {
	ctx, cancel := d.ctx(ctx)
	defer cancel()
	pid, err := parsePoolID(req.PoolID)
	if err != nil {
		return err
	}
	a, err := netip.ParseAddr(req.Address)
	if err != nil {
		return fmt.Errorf("%w: address %q: %v", pool.ErrInvalid, req.Address, err)
	}
	def, err := d.alloc.Definition(ctx, pid.Pool)
	if errors.Is(err, pool.ErrUnknownPool) {
		return nil
	}
	if err != nil {
		return err
	}
	if !def.Contains(a) {
		return nil // the gateway, or an address the pool never hands out
	}
	if held, err := d.releaseAux(ctx, pid, a); held || err != nil {
		return err
	}
	al, held, err := d.alloc.HolderOf(ctx, pid.Pool, a)
	if err != nil {
		return err
	}
	// Only a Docker endpoint's address on this host is released: a release
	// that comes late (a replay, a retry after the driver died mid-request)
	// for an address a CNI container on the same host name holds now must
	// not free it.
	if got, ok := al.Addr(pid.Pool, pool.RoleIP); held && al.Owner.Kind == pool.KindDocker && al.Host == d.host && ok && got == a {
		if _, _, err := d.alloc.Release(ctx, al.Owner); err != nil {
			return err
		}
		d.m.released(a.Is4())
		d.log.Info("released", "pool", pid.Pool, "owner", al.Owner.String(), "addr", a)
		return nil
	}
	d.log.Info("release of an address no Docker endpoint of this host holds", "pool", pid.Pool, "addr", a)
	return nil
}

// releaseAux drops this host's claim on an aux reservation; the last
// claim frees the address. held is false if a is not reserved as aux.
func (d *Driver) releaseAux(ctx context.Context, pid poolID, a netip.Addr) (held bool, err error) {
	o := auxOwner(pid.Pool, a)
	al, ok, err := d.alloc.Lookup(ctx, o)
	if err != nil || !ok {
		return false, err
	}
	if got, _ := al.Addr(pid.Pool, pool.RoleIP); got != a {
		return false, nil
	}
	if len(al.Holders) == 0 {
		// Recorded before shared owners: adopt the markers' hosts first.
		adopt, markers, err := d.legacyAux(ctx, pid, a)
		if err != nil {
			return true, err
		}
		if _, err := d.alloc.Share(ctx, o, pool.Want{Pool: pid.Pool, Role: pool.RoleIP, Addr: a}, adopt...); err != nil {
			return true, fmt.Errorf("aux address %s: %w", a, err)
		}
		d.dropMarkers(ctx, markers)
	}
	_, _, released, err := d.alloc.Unshare(ctx, o)
	if err != nil {
		return true, fmt.Errorf("release aux address %s: %w", a, err)
	}
	if released {
		d.log.Info("released aux address", "pool", pid.Pool, "addr", a)
	}
	return true, nil
}

func auxPrefix(poolName string, a netip.Addr) string {
	return "docker/aux/" + poolName + "/" + a.String() + "/"
}

func auxKey(poolName string, a netip.Addr, host string) string {
	return auxPrefix(poolName, a) + host
}

// boolOpt reads an --ipam-opt that is "true" or "false" (absent: false).
func boolOpt(opts map[string]string, name string) (bool, error) {
	switch v := opts[name]; v {
	case "", "false":
		return false, nil
	case "true":
		return true, nil
	default:
		return false, fmt.Errorf("%w: --ipam-opt %s=%q: want true or false", pool.ErrInvalid, name, v)
	}
}
