package portalloc

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
	"github.com/ringipam/ringipam/pkg/store/storetest"
)

// runCommitRace: two requests for one dynamic port read the store before
// either commits (storetest.Barrier on the commits that write a port's key;
// a first use's index build passes), on a range of one port (the loser finds
// it exhausted) and of two ports (both endpoints start their search at the
// same number: the loser retries onto the other), in ingress mode (two
// hosts) and host mode (two endpoints of one host). Only the commit's
// per-port revision conditions stop both from taking the same port.
func runCommitRace(t *testing.T, st store.Store) {
	lo := uint16(31000)
	for _, mode := range []Mode{Ingress, Host} {
		for _, size := range []uint16{1, 2} {
			hi := lo + size - 1
			t.Run(fmt.Sprintf("%s/range %d", mode, size), func(t *testing.T) {
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				b := storetest.NewBarrier(st, 2, storetest.Writing(prefixAddr))
				hosts := []string{"h1", "h2"}
				if mode == Host {
					hosts[1] = "h1" // host ports are unique per host
				}
				var as [2]*Allocator
				for i, h := range hosts {
					a, err := New(b, h, WithDynamicRange(lo, hi))
					if err != nil {
						t.Fatal(err)
					}
					as[i] = a
				}
				// Two endpoints whose searches start at the same number, so
				// that both plan the same port.
				ids := [2]EndpointID{ep(fmt.Sprintf("race-%s-%d-a", mode, size))}
				for i := 0; ids[1] == (EndpointID{}); i++ {
					if id := ep(fmt.Sprintf("race-%s-%d-b%d", mode, size, i)); as[1].start(id.String()) == as[0].start(ids[0].String()) {
						ids[1] = id
					}
				}
				spec := []Port{{Mode: mode, Name: "80", Protocol: "tcp"}}
				var res [2]Result
				var errs [2]error
				var wg sync.WaitGroup
				for i := range 2 {
					wg.Go(func() { res[i], errs[i] = as[i].Allocate(ctx, ids[i], spec) })
				}
				wg.Wait()
				if b.Arrived() != 2 {
					t.Fatalf("%d commits reached the barrier, want 2 (%v)", b.Arrived(), errs)
				}
				var won []uint16
				for i := range 2 {
					switch {
					case errs[i] == nil:
						won = append(won, res[i].Ports[0].Number)
					case size == 1 && errors.Is(errs[i], ErrExhausted):
					default:
						t.Errorf("%s: %v", ids[i], errs[i])
					}
				}
				switch {
				case len(won) == 2 && won[0] == won[1]:
					t.Errorf("duplicate %s port %d: both %s and %s were given it", mode, won[0], ids[0], ids[1])
				case size == 1 && len(won) != 1:
					t.Errorf("one port, two requests: %d won (ports %v, errors %v), want exactly one, the other exhausted", len(won), won, errs)
				case size == 2 && len(won) != 2:
					t.Errorf("two ports, two requests: %d won (ports %v, errors %v), want both on distinct ports", len(won), won, errs)
				}
				// The store agrees: every port one holder, every record
				// listed by its port's key.
				if findings, err := Audit(ctx, st, Holders{}); err != nil || len(findings) > 0 {
					t.Errorf("store after the race: %v\n%v", err, findings)
				}
				for i := range 2 {
					if _, err := as[i].Release(ctx, ids[i]); err != nil {
						t.Errorf("release %s: %v", ids[i], err)
					}
				}
			})
			lo += 10
		}
	}
}

func TestCommitRaceMemory(t *testing.T) { runCommitRace(t, memory.New()) }
