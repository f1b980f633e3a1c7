package driver

import (
	"errors"
	"net"
	"strings"

	"github.com/ringipam/ringipam/pkg/pool"
)

// Class names the kind of an error for metrics and logs: "ok" for nil,
// otherwise one of pool.Class's names (invalid, in_use, exists,
// no_capacity, mismatch, unknown_pool, unavailable, try_again, timeout,
// internal), ranked by pool.Classify as the CNI plugin ranks them.
func Class(err error) string { return pool.Classify(err).String() }

// Message is the text the driver returns to dockerd for err, which
// `docker network create` and `docker run` print after
// "Error response from daemon: IpamDriver.<Method>: ". It names the cause
// first so that the line reads on its own.
func Message(err error) string {
	var inUse *pool.InUseError
	switch {
	case errors.As(err, &inUse) && inUse.Addr.IsValid():
		msg := "address " + inUse.Addr.String() + " is already in use by " + describeHolder(inUse.Holder)
		if inUse.Host != "" {
			msg += " on host " + inUse.Host
		}
		return msg + " (pool " + inUse.Pool + ")"
	case pool.Classify(err).Retryable():
		return "ringipam: try again later: " + err.Error()
	default:
		return "ringipam: " + err.Error()
	}
}

// describeHolder renders an owner ("network/containerID/ifName") for
// people: a Docker endpoint by its MAC, an aux address, or a CNI container.
func describeHolder(owner string) string {
	parts := strings.SplitN(owner, "/", 3)
	if len(parts) != 3 {
		return owner
	}
	if strings.HasPrefix(parts[1], "aux-") && parts[2] == "" {
		return "an --aux-address reservation"
	}
	if _, err := net.ParseMAC(parts[1]); err == nil {
		return "the Docker endpoint with MAC " + parts[1]
	}
	s := "container " + parts[1] + " of network " + parts[0]
	if parts[2] != "" {
		s += " (interface " + parts[2] + ")"
	}
	return s
}
