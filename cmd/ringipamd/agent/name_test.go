package agent

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/ringipam/ringipam/pkg/agentapi"
)

type okHandler struct{}

func (okHandler) Serve(context.Context, *agentapi.Request) agentapi.Answer {
	return agentapi.Answer{Stdout: []byte("{}")}
}

// TestNameGuardFailsStatusOnceTheNameIsLost: while another instance holds
// this host's name, the plugins' STATUS (and ADD) through the agent fail
// with code 11; DEL still runs; holding the name again serves all.
func TestNameGuardFailsStatusOnceTheNameIsLost(t *testing.T) {
	var lost atomic.Bool
	g := nameGuard{inner: okHandler{}, lost: lost.Load, host: "h1"}
	answer := func(cmd string) agentapi.Answer {
		return g.Serve(context.Background(), &agentapi.Request{Plugin: agentapi.PluginIPAM, Command: cmd})
	}
	if a := answer("STATUS"); a.Failed() {
		t.Fatalf("STATUS with the name held: %+v", a)
	}
	lost.Store(true)
	for _, cmd := range []string{"STATUS", "ADD", "GC"} {
		a := answer(cmd)
		if a.CNIError == nil || a.CNIError.Code != 11 || !strings.Contains(a.CNIError.Msg, "another ringipamd holds this host's name") {
			t.Fatalf("%s with the name lost: %+v, want code 11 naming the cause", cmd, a.CNIError)
		}
	}
	if a := answer("DEL"); a.Failed() {
		t.Fatalf("DEL with the name lost: %+v", a)
	}
	lost.Store(false)
	if a := answer("STATUS"); a.Failed() {
		t.Fatalf("STATUS with the name held again: %+v", a)
	}
}
