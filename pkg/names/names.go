// Package names holds the one set of rules for the names that make up an
// owner of addresses and ports -- a network (or pool) name, a container
// ID, an interface name, a reservation name, a Docker endpoint's MAC
// address -- so that every front end (ipam-ring, the agent's invocations,
// portmap-ingress, the Docker driver) refuses a bad name at its edge, with
// one clear error naming the field, before any store work.
//
// Contract:
//   - Every check returns nil or a *Error, which wraps ErrInvalid and
//     whose message names the field ("container ID ...: ..."). Front ends
//     map ErrInvalid to their wire form: CNI code 7, or the Docker
//     driver's error string (pool.Classify counts it as invalid).
//   - The rules are those an operator of CNI and Docker expects:
//     network names and container IDs as libcni and skel check them (a
//     letter or digit, then letters, digits, '_', '.', '-'), at most
//     MaxLen bytes; interface names as Linux takes them (1-15 bytes, not
//     "." or "..", no '/', ':', whitespace or control characters);
//     reservation names are one or more such names joined by '/' (a pod's
//     "namespace/name"); pool names as pool.Def takes them (1-200 bytes of
//     letters, digits, '.', '_', ':', '-', not starting with a symbol);
//     a Docker endpoint MAC is a 48-bit Ethernet address.
//   - None of these names can hold '/' where a store key separates parts
//     (reservation names are the last part of their key), nor control
//     characters that would corrupt logs.
//
// pkg/pool's Owner.Validate stays as the store's last guard of its key
// layout; this package is the door.
package names

import (
	"errors"
	"fmt"
	"net"
	"strings"
	"unicode"
)

// ErrInvalid is wrapped by every error of this package.
var ErrInvalid = errors.New("invalid name")

// MaxLen bounds a network name, a container ID and a reservation name: far
// above real ones (a 64-hex container ID, a 253-byte DNS name), far below
// any store's key limit.
const MaxLen = 253

// MaxIfName is the longest Linux interface name (IFNAMSIZ-1).
const MaxIfName = 15

// Fields, as error messages name them.
const (
	FieldNetwork     = "network name"
	FieldPool        = "pool name"
	FieldContainerID = "container ID"
	FieldIfName      = "interface name"
	FieldReservation = "reservation name"
	FieldMAC         = "endpoint MAC address"
)

// Error is a refused name: the field, its value and the rule it breaks.
type Error struct {
	Field string
	Value string
	Rule  string
}

func (e *Error) Error() string {
	v := e.Value
	if len(v) > 64 {
		v = v[:64] + "..."
	}
	return fmt.Sprintf("%s %q: %s", e.Field, v, e.Rule)
}

// Unwrap returns ErrInvalid.
func (e *Error) Unwrap() error { return ErrInvalid }

const cniRule = "must be a letter or digit followed by letters, digits, '_', '.' or '-'"

// IsCNIName reports whether s is a CNI name: a letter or digit, then
// letters, digits, '_', '.' or '-' (libcni's rule for network names and
// container IDs).
func IsCNIName(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		alnum := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
		if !alnum && (i == 0 || c != '_' && c != '.' && c != '-') {
			return false
		}
	}
	return s != ""
}

func checkCNI(field, s string) error {
	switch {
	case s == "":
		return &Error{field, s, "is empty"}
	case len(s) > MaxLen:
		return &Error{field, s, fmt.Sprintf("is %d bytes long, more than %d", len(s), MaxLen)}
	case !IsCNIName(s):
		return &Error{field, s, cniRule}
	}
	return nil
}

// Network checks a CNI network name.
func Network(s string) error { return checkCNI(FieldNetwork, s) }

// ContainerID checks a CNI container ID.
func ContainerID(s string) error { return checkCNI(FieldContainerID, s) }

// IfName checks an interface name.
func IfName(s string) error {
	switch {
	case s == "":
		return &Error{FieldIfName, s, "is empty"}
	case len(s) > MaxIfName:
		return &Error{FieldIfName, s, fmt.Sprintf("is %d bytes long, more than Linux's %d", len(s), MaxIfName)}
	case s == "." || s == "..":
		return &Error{FieldIfName, s, "may not be \".\" or \"..\""}
	}
	for _, r := range s {
		if r == '/' || r == ':' || unicode.IsSpace(r) || unicode.IsControl(r) || r == unicode.ReplacementChar {
			return &Error{FieldIfName, s, "may not contain '/', ':', whitespace or control characters"}
		}
	}
	return nil
}

// CNI checks the three parts of a CNI attachment's owner, in order.
func CNI(network, containerID, ifName string) error {
	if err := Network(network); err != nil {
		return err
	}
	if err := ContainerID(containerID); err != nil {
		return err
	}
	return IfName(ifName)
}

// Reservation checks a reservation name; "" (no reservation) passes.
func Reservation(s string) error {
	if s == "" {
		return nil
	}
	if len(s) > MaxLen {
		return &Error{FieldReservation, s, fmt.Sprintf("is %d bytes long, more than %d", len(s), MaxLen)}
	}
	for _, part := range strings.Split(s, "/") {
		if !IsCNIName(part) {
			return &Error{FieldReservation, s, "must be one or more names joined by '/' (namespace/name), each " + cniRule}
		}
	}
	return nil
}

// Pool checks a pool name (a Docker network's pool, --ipam-opt pool=).
func Pool(s string) error {
	ok := len(s) >= 1 && len(s) <= 200
	for i := 0; ok && i < len(s); i++ {
		c := s[i]
		alnum := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
		ok = alnum || i > 0 && (c == '.' || c == '_' || c == ':' || c == '-')
	}
	if !ok {
		return &Error{FieldPool, s, "must be 1-200 characters of letters, digits, '.', '_', ':' or '-', starting with a letter or digit"}
	}
	return nil
}

// MAC checks a Docker endpoint's MAC address and returns it in canonical
// form (lower-case hex pairs joined by ':').
func MAC(s string) (string, error) {
	hw, err := net.ParseMAC(s)
	if err != nil {
		return "", &Error{FieldMAC, s, "is not a MAC address"}
	}
	if len(hw) != 6 {
		return "", &Error{FieldMAC, s, fmt.Sprintf("has %d bytes, not the 6 of an Ethernet address", len(hw))}
	}
	return hw.String(), nil
}
