package agent

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ringipam/ringipam/pkg/store/relay"
)

type okInvoker struct{}

func (okInvoker) Accept(*relay.Invocation) (func(context.Context) relay.Outcome, time.Duration, bool) {
	return func(context.Context) relay.Outcome { return relay.Outcome{Stdout: []byte("{}")} }, time.Second, true
}

// TestNameGuardFailsStatusOnceTheNameIsLost: while another instance holds
// this host's name, the plugins' STATUS (and ADD) through the agent fail
// with code 11; DEL still runs; holding the name again serves all.
func TestNameGuardFailsStatusOnceTheNameIsLost(t *testing.T) {
	var lost atomic.Bool
	g := nameGuard{inner: okInvoker{}, lost: lost.Load, host: "h1"}
	outcome := func(cmd string) relay.Outcome {
		run, _, ok := g.Accept(&relay.Invocation{Command: cmd})
		if !ok {
			t.Fatalf("%s not accepted", cmd)
		}
		return run(context.Background())
	}
	if o := outcome("STATUS"); o.Error != nil {
		t.Fatalf("STATUS with the name held: %s", o.Error)
	}
	lost.Store(true)
	for _, cmd := range []string{"STATUS", "ADD", "GC"} {
		o := outcome(cmd)
		if e := string(o.Error); !strings.Contains(e, `"code":11`) || !strings.Contains(e, "another ringipamd holds this host's name") {
			t.Fatalf("%s with the name lost: %q, want code 11 naming the cause", cmd, e)
		}
	}
	if o := outcome("DEL"); o.Error != nil {
		t.Fatalf("DEL with the name lost: %s", o.Error)
	}
	lost.Store(false)
	if o := outcome("STATUS"); o.Error != nil {
		t.Fatalf("STATUS with the name held again: %s", o.Error)
	}
}
