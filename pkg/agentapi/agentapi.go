// Package agentapi is the one API between the CNI plugins (ipam-ring,
// portmap-ingress) and the host agent (ringipamd) on an etcd store: the
// plugin sends its whole invocation to the agent on a unix socket, the
// agent runs the plugin's verb with the same code (packages pkg/cni/...)
// on its own open store and answers with what the plugin prints.
//
// Wire format: one connection per invocation; the plugin writes one
// Request as one line of JSON (encoding/json), the agent answers with one
// Answer as one line and closes. Both carry the protocol Version. An agent
// that gets a request of another version answers an Answer of its own
// version with only Error set (naming both versions); a plugin that gets
// an answer of another version reports it (*VersionError, CNI code 11).
// Neither side ever falls back to something else.
//
// Contract:
//   - Client side (Call): the connection is made with a deadline; a
//     connection that cannot be made is ErrNoAgent (nothing listens on
//     the socket, or it is not there); an answer that does not come back
//     once the request went out is ErrNoAnswer (the call may have run);
//     an agent that refused the request (another version: *VersionError;
//     another reason: ErrRefused) is reported as such. Call never runs
//     anything itself.
//   - Plugin side (Forward): ADD, CHECK, GC and STATUS without an agent
//     fail with CNI code 11 naming the socket and the service to start;
//     DEL without an agent (or refused for another version, or left
//     without an answer) is queued on disk (DelQueue) and succeeds.
//   - Server side (Server): the socket is created 0600 in a directory made
//     0700; every connection's peer credentials are checked (package
//     peercred, root only by default) before a byte is read; a request
//     line is at most MaxRequest bytes and must arrive within
//     RequestTimeout; each connection has its own goroutine; the
//     invocation's context ends at the request's timeout (bounded by
//     MaxCallTimeout) and when the plugin closes its connection (the
//     runtime killed it), so a plugin that is gone commits nothing more.
//     Which plugin runs is the Handler registered under Request.Plugin.
//   - The DEL queue (DelQueue): one file per queued DEL, named by a hash
//     of plugin, network, container ID and interface name (a repeated DEL
//     replaces the one before), written to a temporary file, fsynced and
//     renamed (a crash leaves a whole entry or none, and stray temporary
//     files that Drain removes); bounded (MaxQueued entries of at most
//     MaxQueuedSize bytes: a DEL that does not fit fails with code 11 and
//     says so); Drain runs each entry through a Handler and removes it
//     only after it succeeded.
package agentapi

import (
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/containernetworking/cni/pkg/types"
)

// Version is the protocol version this package speaks. A change that an
// agent or plugin of the version before would misread takes the next one.
const Version = 1

// Plugin names a Request may carry.
const (
	PluginIPAM    = "ipam-ring"
	PluginPortmap = "portmap-ingress"
)

// Limits of the protocol.
const (
	// MaxRequest bounds one request line: a plugin's stdin (skel reads it
	// whole; a network configuration is kilobytes) base64-encoded in JSON,
	// with room to spare. The server closes a connection whose line is
	// longer after reading MaxRequest+1 bytes; the client refuses to send
	// one.
	MaxRequest = 8 << 20
	// MaxAnswer bounds one answer line the client reads.
	MaxAnswer = 8 << 20
	// RequestTimeout is how long the server waits for a whole request line
	// after it accepted a connection.
	RequestTimeout = 30 * time.Second
	// DefaultCallTimeout bounds an invocation whose request has no
	// timeout; MaxCallTimeout bounds any invocation.
	DefaultCallTimeout = 30 * time.Second
	MaxCallTimeout     = 10 * time.Minute
	// AnswerGrace is added to the call's timeout for the answer's way
	// back: the client waits that long in all.
	AnswerGrace = 2 * time.Second
	// DialTimeout bounds the connection (a full accept queue).
	DialTimeout = 5 * time.Second
)

// Request is one whole plugin invocation, as the plugin received it.
type Request struct {
	// Version is the sender's protocol version (Version).
	Version int `json:"version"`
	// Plugin is PluginIPAM or PluginPortmap.
	Plugin string `json:"plugin"`
	// Command is CNI_COMMAND: ADD, DEL, CHECK, GC or STATUS.
	Command     string `json:"command"`
	ContainerID string `json:"containerId,omitempty"`
	Netns       string `json:"netns,omitempty"`
	IfName      string `json:"ifName,omitempty"`
	// Args is CNI_ARGS.
	Args string `json:"args,omitempty"`
	// Path is CNI_PATH.
	Path string `json:"path,omitempty"`
	// Hostname is the plugin's hostname: the host name a configuration
	// without one means (the agent may run in another UTS namespace).
	Hostname string `json:"hostname,omitempty"`
	// TimeoutMS is the plugin's configured call timeout in milliseconds
	// (0: DefaultCallTimeout); the agent runs the call under it.
	TimeoutMS int64  `json:"timeoutMs,omitempty"`
	Stdin     []byte `json:"stdin"`
}

// Timeout is the call's timeout: TimeoutMS, DefaultCallTimeout when
// unset, at most MaxCallTimeout.
func (r *Request) Timeout() time.Duration {
	d := time.Duration(r.TimeoutMS) * time.Millisecond
	switch {
	case d <= 0:
		return DefaultCallTimeout
	case d > MaxCallTimeout:
		return MaxCallTimeout
	}
	return d
}

// Answer is the agent's answer to one Request.
type Answer struct {
	// Version is the agent's protocol version.
	Version int `json:"version"`
	// Stdout is what the plugin prints (the result of ADD).
	Stdout []byte `json:"stdout,omitempty"`
	// Stderr is what the verb logged (the plugin writes it to its
	// stderr).
	Stderr []byte `json:"stderr,omitempty"`
	// CNIError is the verb's error, which the plugin prints and exits 1
	// with.
	CNIError *types.Error `json:"cniError,omitempty"`
	// Error, when set, says that the agent did not run the request: its
	// protocol version differs, its plugin is unknown, it was malformed
	// or it does not name the agent's store.
	Error string `json:"error,omitempty"`
}

// Failed reports whether a did not succeed: not run, or run and failed.
func (a *Answer) Failed() bool { return a.Error != "" || a.CNIError != nil }

// Errors of the client side.
var (
	// ErrNoAgent: the connection to the socket could not be made (nothing
	// listens there, or no socket at all).
	ErrNoAgent = errors.New("no host agent answers")
	// ErrNoAnswer: the request went out but no whole answer came back
	// (the agent stopped, or the wait ended); the call may have run.
	ErrNoAnswer = errors.New("the host agent did not answer")
	// ErrRefused: the agent answered without running the request
	// (Answer.Error).
	ErrRefused = errors.New("the host agent refused the call")
	// ErrVersion is wrapped by *VersionError.
	ErrVersion = errors.New("agent API version mismatch")
)

// VersionError is an agent that speaks another protocol version than
// this plugin.
type VersionError struct {
	Socket string
	Agent  int // the agent's version
	Plugin int // this side's version
	// Detail is the agent's own message, if it sent one.
	Detail string
}

func (e *VersionError) Error() string {
	msg := fmt.Sprintf("agent at %s speaks agent API v%d, this plugin v%d: upgrade the older of the two (ringipamd or the plugin binaries) so that both speak one version",
		e.Socket, e.Agent, e.Plugin)
	if e.Detail != "" {
		msg += " (the agent says: " + e.Detail + ")"
	}
	return msg
}

// Unwrap makes errors.Is(err, ErrVersion) hold.
func (e *VersionError) Unwrap() error { return ErrVersion }

// versionRefusal is the agent's Answer.Error for a request of version v.
func versionRefusal(agent, plugin int) string {
	return fmt.Sprintf("this agent speaks agent API v%d, the plugin sent v%d: upgrade the older of the two (ringipamd or the plugin binaries)", agent, plugin)
}

// networkName reads the network's name from a configuration; "" when it
// cannot be read (the DEL queue's key then goes without it).
func networkName(stdin []byte) string {
	var n struct {
		Name string `json:"name"`
	}
	_ = json.Unmarshal(stdin, &n)
	return n.Name
}
