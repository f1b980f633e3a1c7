package names_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/ringipam/ringipam/pkg/names"
)

func TestRules(t *testing.T) {
	long := strings.Repeat("a", names.MaxLen+1)
	mac := func(s string) error { _, err := names.MAC(s); return err }
	for _, tc := range []struct {
		field string
		check func(string) error
		good  []string
		bad   []string
	}{
		{names.FieldNetwork, names.Network, []string{"net1", "a.b_c-d", strings.Repeat("n", names.MaxLen)},
			[]string{"", "a/b", "-a", ".a", "a b", "a\x01", "é", long}},
		{names.FieldContainerID, names.ContainerID, []string{"cnitool-0123abcd", "0" + strings.Repeat("f", 63)},
			[]string{"", "../x", "a/b", "..", "x\ny", long}},
		{names.FieldIfName, names.IfName, []string{"eth0", "net1.100", "a-b_c@d"},
			[]string{"", ".", "..", "e/th", "eth:0", "eth 0", "eth\x01", strings.Repeat("e", 16)}},
		{names.FieldReservation, names.Reservation, []string{"", "db-0", "ns/pod-a", "a/b/c"},
			[]string{"/a", "a/", "a//b", "ns/../x", "a b", "a\x00", long}},
		{names.FieldPool, names.Pool, []string{"198.18.7.0-24", "fd00:1::-64", "p_1"},
			[]string{"", "a/b", ":a", "a;b", strings.Repeat("p", 201)}},
		{names.FieldMAC, mac, []string{"02:42:ac:11:00:02", "02-42-AC-11-00-02"},
			[]string{"", "zz", "02:42:ac:11:00:02:00:00", "02:42:ac:11:00"}},
	} {
		for _, s := range tc.good {
			if err := tc.check(s); err != nil {
				t.Errorf("%s %q refused: %v", tc.field, s, err)
			}
		}
		for _, s := range tc.bad {
			err := tc.check(s)
			if !errors.Is(err, names.ErrInvalid) || !strings.HasPrefix(err.Error(), tc.field+" ") {
				t.Errorf("%s %q: %v, want an ErrInvalid naming the field", tc.field, s, err)
			}
		}
	}
	if got, _ := names.MAC("02-42-AC-11-00-02"); got != "02:42:ac:11:00:02" {
		t.Errorf("canonical MAC %q", got)
	}
}

func TestCNIOrder(t *testing.T) {
	err := names.CNI("net", "a/b", "e/th")
	var ne *names.Error
	if !errors.As(err, &ne) || ne.Field != names.FieldContainerID {
		t.Fatalf("CNI: %v, want the container ID named first", err)
	}
}
