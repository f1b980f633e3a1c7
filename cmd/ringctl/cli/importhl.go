package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/ringipam/ringipam/pkg/cni/ipam"
	"github.com/ringipam/ringipam/pkg/pool"
)

// ImportArgs says what import host-local adopts.
type ImportArgs struct {
	// Dir is host-local's data directory of the network (by default
	// /var/lib/cni/networks/<network>): one file per address, named by the
	// address, holding "<container ID>\r\n<interface>".
	Dir string
	// Network is the CNI network name the containers are attached to; it
	// must be the name in NetConf (the name ipam-ring will be invoked with).
	Network string
	// Host is the host the containers run on; their addresses move into
	// its ranges.
	Host string
	// NetConf is the network's configuration (host-local's or
	// ipam-ring's): its range sets become the pools, as ipam-ring makes them.
	NetConf []byte
	DryRun  bool
}

// Import outcomes of one owner.
const (
	ImportAdopted   = "adopted"   // now held by the owner in the store
	ImportUnchanged = "unchanged" // the owner already held exactly these
	ImportRefused   = "refused"   // another owner holds an address, or the file does not fit the config
)

// ImportedOwner is what import did with one attachment of host-local.
type ImportedOwner struct {
	Owner  pool.Owner   `json:"owner"`
	Addrs  []netip.Addr `json:"addrs"`
	Result string       `json:"result"`
	Detail string       `json:"detail,omitempty"`
}

// ImportReport is the outcome of import host-local.
type ImportReport struct {
	DryRun  bool            `json:"dryRun"`
	Network string          `json:"network"`
	Host    string          `json:"host"`
	Pools   []string        `json:"pools"`
	Owners  []ImportedOwner `json:"owners"`
	// Ignored names files of the directory that are not allocations, and
	// why (host-local's lock and last_reserved_ip files are skipped
	// silently).
	Ignored []string `json:"ignored,omitempty"`
}

// Refused counts the owners import refused.
func (r ImportReport) Refused() int {
	n := 0
	for _, o := range r.Owners {
		if o.Result == ImportRefused {
			n++
		}
	}
	return n
}

// ImportHostLocal adopts host-local's allocations into the store so that
// running containers keep their addresses once the network's conflist
// names ipam-ring: each attachment becomes the owner (cni, network,
// container, interface) of its addresses, allocated on args.Host, in the
// pools ipam-ring derives from the same configuration. It is idempotent,
// never takes an address another owner holds (that owner is refused and
// reported), and with DryRun changes nothing.
func (c *Ctl) ImportHostLocal(ctx context.Context, args ImportArgs) (ImportReport, error) {
	rep := ImportReport{DryRun: args.DryRun, Host: args.Host, Owners: []ImportedOwner{}}
	cfg, err := importConfig(args)
	if err != nil {
		return rep, err
	}
	rep.Network = cfg.Network
	defs := cfg.Defs()
	for _, d := range defs {
		rep.Pools = append(rep.Pools, d.Name)
	}
	files, err := readHostLocalDir(args.Dir)
	if err != nil {
		return rep, err
	}
	rep.Ignored = files.ignored
	// The addresses are allocated on the containers' host: they move into
	// its ranges, and its GC covers them.
	a, err := c.poolAs(args.Host)
	if err != nil {
		return rep, err
	}
	if !args.DryRun {
		// Record the pools first (or find them recorded as configured), so
		// a mismatch is one clear error rather than one per owner.
		if err := a.Define(ctx, defs...); err != nil {
			return rep, fmt.Errorf("recording the pools of network %s: %w", cfg.Network, err)
		}
	}
	for _, at := range files.attachments {
		owner := pool.Owner{Kind: pool.KindCNI, Network: cfg.Network, ContainerID: at.container, IfName: at.ifName}
		rep.Owners = append(rep.Owners, importOne(ctx, a, cfg, owner, at.addrs, args.DryRun))
	}
	return rep, nil
}

func importOne(ctx context.Context, a *pool.Allocator, cfg *ipam.Config, owner pool.Owner, addrs []netip.Addr, dry bool) ImportedOwner {
	out := ImportedOwner{Owner: owner, Addrs: addrs}
	refuse := func(format string, a ...any) ImportedOwner {
		out.Result, out.Detail = ImportRefused, fmt.Sprintf(format, a...)
		return out
	}
	if err := owner.Validate(); err != nil {
		return refuse("%v", err)
	}
	var wants []pool.Want
	for _, addr := range addrs {
		i := slices.IndexFunc(cfg.RangeSets, func(rs ipam.RangeSet) bool { return rs.Def.Contains(addr) })
		if i < 0 {
			return refuse("%s is in no range of the configuration", addr)
		}
		name := cfg.RangeSets[i].Def.Name
		if slices.ContainsFunc(wants, func(w pool.Want) bool { return w.Pool == name }) {
			return refuse("two addresses in one range set (pool %s); ipam-ring gives one per range set", name)
		}
		wants = append(wants, pool.Want{Pool: name, Role: pool.RoleIP, Addr: addr})
	}
	var missing []string
	for _, rs := range cfg.RangeSets {
		if !slices.ContainsFunc(wants, func(w pool.Want) bool { return w.Pool == rs.Def.Name }) {
			missing = append(missing, rs.Def.Name)
		}
	}
	if len(missing) > 0 {
		out.Detail = "no address in pool " + strings.Join(missing, ", ") + ": ipam-ring's CHECK will fail for it"
	}
	held, ok, err := a.Lookup(ctx, owner)
	if err != nil {
		return refuse("looking up the owner: %v", err)
	}
	if ok {
		if sameAddrs(addrsOf(held), addrs) {
			out.Result = ImportUnchanged
			return out
		}
		return refuse("already holds %v in the store (allocated on host %s)", addrsOf(held), held.Host)
	}
	if dry {
		for _, w := range wants {
			h, taken, err := a.HolderOf(ctx, w.Pool, w.Addr)
			if err != nil {
				return refuse("looking up %s: %v", w.Addr, err)
			}
			if taken {
				return refuse("%s is already in use by %s", w.Addr, describeAlloc(h))
			}
		}
		out.Result = ImportAdopted
		return out
	}
	var defs []pool.Def // the wanted pools' definitions, verified in the allocation's own read
	for _, rs := range cfg.RangeSets {
		if slices.ContainsFunc(wants, func(w pool.Want) bool { return w.Pool == rs.Def.Name }) {
			defs = append(defs, rs.Def)
		}
	}
	_, err = a.Allocate(ctx, pool.Request{Owner: owner, Wants: wants, Defs: defs})
	var inUse *pool.InUseError
	switch {
	case errors.As(err, &inUse) && inUse.Name != "":
		return refuse("%s is already in use by reservation %s (a hold)", inUse.Addr, inUse.Name)
	case errors.As(err, &inUse):
		return refuse("%s is already in use by %s on host %s", inUse.Addr, inUse.Holder, inUse.Host)
	case err != nil:
		return refuse("%v", err)
	}
	out.Result = ImportAdopted
	return out
}

func describeAlloc(a pool.Allocation) string {
	if a.Owner.ContainerID == "" {
		return "reservation " + a.Reservation + " (a hold)"
	}
	return a.Owner.String() + " on host " + a.Host
}

func sameAddrs(a, b []netip.Addr) bool {
	x, y := slices.Clone(a), slices.Clone(b)
	slices.SortFunc(x, netip.Addr.Compare)
	slices.SortFunc(y, netip.Addr.Compare)
	return slices.Equal(x, y)
}

// importConfig loads the network's configuration as ipam-ring would, with
// the ipam type switched to ipam-ring and host-local-only keys dropped.
func importConfig(args ImportArgs) (*ipam.Config, error) {
	if len(args.NetConf) == 0 {
		return nil, usagef("import needs the network's configuration: --config (or --conflist) naming its conflist")
	}
	var net map[string]json.RawMessage
	if err := json.Unmarshal(args.NetConf, &net); err != nil {
		return nil, usagef("network config: %v", err)
	}
	var ipamConf map[string]json.RawMessage
	if err := json.Unmarshal(net["ipam"], &ipamConf); err != nil || ipamConf == nil {
		return nil, usagef("network config has no \"ipam\" object")
	}
	ipamConf["type"] = json.RawMessage(`"ipam-ring"`)
	delete(ipamConf, "resolvConf") // host-local only; not an address setting
	host, _ := json.Marshal(args.Host)
	ipamConf["host"] = host
	net["ipam"], _ = json.Marshal(ipamConf)
	b, _ := json.Marshal(net)
	cfg, err := ipam.Load(b, "")
	if err != nil {
		return nil, fmt.Errorf("%w: %w", errUsage, err)
	}
	if args.Network != "" && args.Network != cfg.Network {
		return nil, usagef("--network %s differs from the configuration's name %s, under which ipam-ring will see the containers", args.Network, cfg.Network)
	}
	if cfg.GatewayMode != ipam.GatewayShared {
		return nil, usagef("import supports gatewayMode \"shared\" only (host-local has no per-container gateways)")
	}
	return cfg, nil
}

type hostLocalAttachment struct {
	container, ifName string
	addrs             []netip.Addr
}

type hostLocalDir struct {
	attachments []hostLocalAttachment
	ignored     []string
}

// readHostLocalDir reads host-local's data directory of one network.
func readHostLocalDir(dir string) (hostLocalDir, error) {
	var out hostLocalDir
	entries, err := os.ReadDir(dir)
	if err != nil {
		return out, fmt.Errorf("%w: reading host-local's data directory: %w", errUsage, err)
	}
	byOwner := map[[2]string]*hostLocalAttachment{}
	var order [][2]string
	for _, e := range entries {
		name := e.Name()
		if name == "lock" || strings.HasPrefix(name, "last_reserved_ip") {
			continue
		}
		if !e.Type().IsRegular() {
			out.ignored = append(out.ignored, name+": not a regular file")
			continue
		}
		addr, err := netip.ParseAddr(name)
		if err != nil {
			out.ignored = append(out.ignored, name+": not named by an address")
			continue
		}
		b, err := fs.ReadFile(os.DirFS(dir), name)
		if err != nil {
			return out, fmt.Errorf("reading %s: %w", filepath.Join(dir, name), err)
		}
		id, ifName, _ := strings.Cut(string(b), "\n")
		id, ifName = strings.TrimSpace(id), strings.TrimSpace(ifName)
		if id == "" {
			out.ignored = append(out.ignored, name+": names no container")
			continue
		}
		if ifName == "" {
			ifName = "eth0" // files of host-local before v0.8 held the container ID only
		}
		k := [2]string{id, ifName}
		if byOwner[k] == nil {
			byOwner[k] = &hostLocalAttachment{container: id, ifName: ifName}
			order = append(order, k)
		}
		byOwner[k].addrs = append(byOwner[k].addrs, addr.Unmap())
	}
	slices.SortFunc(order, func(a, b [2]string) int { return strings.Compare(a[0]+"/"+a[1], b[0]+"/"+b[1]) })
	for _, k := range order {
		at := byOwner[k]
		slices.SortFunc(at.addrs, func(a, b netip.Addr) int {
			if a.Is4() != b.Is4() {
				if a.Is4() {
					return -1
				}
				return 1
			}
			return a.Compare(b)
		})
		out.attachments = append(out.attachments, *at)
	}
	return out, nil
}
