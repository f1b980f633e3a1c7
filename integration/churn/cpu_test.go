//go:build integration

package churn

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// cpuUse is the CPU time (user + system) of what a churn runs, by part:
// the plugin processes (the test's children that ended: libcni's main
// plugins and what they ran, or the IPAM plugins alone), the ringipamd
// agents, the etcds and kube-apiserver. Where the IPAM time goes: with
// the wall time and the machine's cores it says what was busy and what
// waited.
type cpuUse struct {
	plugins, agents, etcd, apiserver time.Duration
}

func (c cpuUse) add(o cpuUse) cpuUse {
	return cpuUse{c.plugins + o.plugins, c.agents + o.agents, c.etcd + o.etcd, c.apiserver + o.apiserver}
}

func (c cpuUse) sub(o cpuUse) cpuUse {
	return cpuUse{c.plugins - o.plugins, c.agents - o.agents, c.etcd - o.etcd, c.apiserver - o.apiserver}
}

func (c cpuUse) String() string {
	return fmt.Sprintf("plugin processes %s, ringipamd agents %s, etcd %s, kube-apiserver %s",
		secs(c.plugins), secs(c.agents), secs(c.etcd), secs(c.apiserver))
}

// sampleCPU reads the CPU time so far: the test's ended children
// (getrusage), and each of this suite's servers from /proc/<pid>/stat,
// found by what only their command lines hold (the agents' store prefix,
// the LAN addresses of the etcds, kube-apiserver's directory).
func sampleCPU() cpuUse {
	var c cpuUse
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_CHILDREN, &ru) == nil {
		c.plugins = time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	cmdlines, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range cmdlines {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		var part *time.Duration
		switch {
		case bytes.Contains(b, []byte("\x00/"+mark+"/")):
			part = &c.agents
		case bytes.Contains(b, []byte(ringEtcdIP.String()+":2379")) || bytes.Contains(b, []byte(kubeEtcdIP.String()+":2379")):
			if !bytes.Contains(b, []byte("kube-apiserver")) {
				part = &c.etcd
			} else {
				part = &c.apiserver
			}
		default:
			continue
		}
		*part += procCPU(filepath.Dir(p))
	}
	return c
}

// procCPU is utime + stime of /proc/<pid> (clock ticks of 10 ms, as
// Linux reports them on these machines: USER_HZ 100).
func procCPU(dir string) time.Duration {
	b, err := os.ReadFile(filepath.Join(dir, "stat"))
	if err != nil {
		return 0
	}
	// The command name is in parentheses and may hold spaces: fields
	// count from after its closing one (utime, stime are fields 14, 15).
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return 0
	}
	ut, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(ut+st) * 10 * time.Millisecond
}
