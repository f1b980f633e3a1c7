package agent

import (
	"fmt"
	"time"
)

// The agent's two health answers, for a supervisor (kubelet's probes):
//
//   - live (/livez): the agent's loops still turn. It does not depend on
//     the store: during an etcd outage the agent is alive and waiting, and
//     restarting it would only drop its lease and its watches. It fails
//     when the heartbeat loop has not started an iteration for longer than
//     stallAfter (every store operation has a deadline, so a loop that
//     stops turning is stuck in the agent, which a restart does fix), or
//     when the plugins' socket stopped serving.
//   - ready (/readyz, and /healthz as before): the agent can serve the
//     plugins now: it is live, holds its host's liveness record (the store
//     answers) and no other agent holds this host's name.

// healthInput is what the answers are computed from.
type healthInput struct {
	now, lastBeat time.Time
	stallAfter    time.Duration
	apiDown       bool // the plugins' socket stopped serving (nil error on a socket never opened)
	held          bool // this agent holds the host's liveness record
	nameLost      bool // another agent holds this host's name
}

// liveness is nil when the agent is alive, else why it is not.
func liveness(in healthInput) error {
	if since := in.now.Sub(in.lastBeat); since > in.stallAfter {
		return fmt.Errorf("the heartbeat loop has not turned for %s (more than %s): the agent is stuck", since.Round(time.Second), in.stallAfter)
	}
	if in.apiDown {
		return fmt.Errorf("the plugins' socket stopped serving")
	}
	return nil
}

// readiness is nil when the agent can serve the plugins, else why not.
func readiness(in healthInput) error {
	if err := liveness(in); err != nil {
		return err
	}
	if in.nameLost {
		return fmt.Errorf("another ringipamd holds this host's name")
	}
	if !in.held {
		return fmt.Errorf("liveness record not held (the store is out of reach or the lease is being renewed)")
	}
	return nil
}

// stallAfter is how long the heartbeat loop may go without starting an
// iteration before the agent counts as stuck: three intervals and three
// store-operation deadlines (one iteration runs a few operations).
func stallAfter(heartbeat, timeout time.Duration) time.Duration {
	return 3*heartbeat + 3*timeout
}
