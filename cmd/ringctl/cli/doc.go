// Package cli holds the cores of the ringctl command: the operator's
// view of a ringipam store (status, ls, ports, history, explain, check) and
// its repairs (release, hold drop, rmpeer, gc, host ack, import of a
// host-local data directory).
//
// Each command is a method of Ctl that computes and returns a value (a
// report, or the list of Actions a repair took or, in a dry run, would
// take); rendering as text (at most 100 columns) or JSON is separate
// (render.go), and Main is the edge that parses arguments, opens the store,
// maps errors to exit codes and prints. A dry run and the real run of a
// repair share one planner, so the real run's actions are the dry run's
// whenever the store did not change in between.
//
// Ctl is not safe for concurrent use by several goroutines that change its
// fields; its methods only read them. Every store call is bounded by the
// pool allocator's timeout (Main sets it from --timeout). A repair that
// fails part-way reports the actions it completed and the error; every
// repair is idempotent, so running it again finishes the job.
package cli
