//go:build integration

package chaos

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"time"
)

// faults injects the suite's faults while the workload runs, one after the
// other in cycles: kill the etcd leader (found through the members' status
// API) and start it again; cut one host off from etcd with nftables and
// heal it; SIGKILL the Docker driver while a request is in flight and
// start it again. (Killing plugin processes mid-ADD is the agents' part.)
// Every wait is bounded; every fault is undone before the next, also when
// the workload ends meanwhile.
type faults struct {
	lab          *lab
	drv          *driverProc
	docker       *dockerClient
	partitionFor time.Duration
	logf         func(format string, args ...any)

	mu             sync.Mutex
	leader         uint64 // the leader seen last
	leaderKills    int
	leaderChanges  int
	partitions     int
	driverRestarts int
	midRequest     int // restarts with the fault's own request in flight (every one, by construction)
	workerRequest  int // restarts that happened with a Docker worker's request in flight too (by chance)
	cycles         int
	errs           []string
}

func (f *faults) fail(format string, args ...any) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.errs = append(f.errs, fmt.Sprintf(format, args...))
}

// sleep waits d or until ctx ends; false when ctx ended.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// run injects fault cycles until ctx ends; with minCycles > 0 it reports
// on done once that many cycles are complete (and goes on until ctx ends).
func (f *faults) run(ctx context.Context, minCycles int, done chan<- struct{}) {
	for i := 0; ; i++ {
		if !sleep(ctx, time.Second) {
			return
		}
		f.killLeader()
		if !sleep(ctx, time.Second) {
			return
		}
		f.partition(f.lab.hosts[i%len(f.lab.hosts)])
		if !sleep(ctx, time.Second) {
			return
		}
		f.restartDriver()
		f.mu.Lock()
		f.cycles++
		n := f.cycles
		f.mu.Unlock()
		if n == minCycles {
			close(done)
		}
	}
}

// observeLeader counts a change when id is not the leader seen last.
func (f *faults) observeLeader(id uint64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if id == 0 || id == f.leader {
		return
	}
	if f.leader != 0 {
		f.leaderChanges++
	}
	f.leader = id
}

// monitorLeader polls the status API until ctx ends, so that leader
// changes the suite did not cause are counted too.
func (f *faults) monitorLeader(ctx context.Context) {
	for sleep(ctx, 200*time.Millisecond) {
		qctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		_, id, err := f.lab.etcd.Leader(qctx)
		cancel()
		if err == nil {
			f.observeLeader(id)
		}
	}
}

// killLeader SIGKILLs the leader, waits (bounded) until the others elect a
// new one, and starts the old leader again on its data.
func (f *faults) killLeader() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var idx int
	var id uint64
	var err error
	for {
		if idx, id, err = f.lab.etcd.Leader(ctx); err == nil {
			f.observeLeader(id)
			break
		}
		if !sleep(ctx, 100*time.Millisecond) {
			f.fail("no etcd leader to kill: %v", err)
			return
		}
	}
	m := f.lab.etcd.Members()[idx]
	start := time.Now()
	m.Stop()
	f.mu.Lock()
	f.leaderKills++
	f.mu.Unlock()
	for {
		_, now, err := f.lab.etcd.Leader(ctx)
		if err == nil && now != id {
			f.observeLeader(now)
			break
		}
		if !sleep(ctx, 50*time.Millisecond) {
			f.fail("no new leader within 30s after killing %s (%x): %v", m.Name(), id, err)
			break
		}
	}
	elected := time.Since(start)
	time.Sleep(time.Second)
	if err := m.Restart(); err != nil {
		f.fail("restart of etcd member %s: %v", m.Name(), err)
		return
	}
	f.logf("fault: killed etcd leader %s (%x), new leader after %s, member back after %s",
		m.Name(), id, elected.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
}

// partition cuts h off from etcd for partitionFor and heals it.
func (f *faults) partition(h *host) {
	heal, err := f.lab.partition(h)
	if err != nil {
		f.fail("%v", err)
		return
	}
	f.mu.Lock()
	f.partitions++
	f.mu.Unlock()
	time.Sleep(f.partitionFor)
	if err := heal(); err != nil {
		f.fail("%v", err)
		return
	}
	f.logf("fault: host %s cut off from etcd for %s, healed", h.name, f.partitionFor)
}

// restartDriver SIGKILLs the driver with a request in flight and starts it
// again. The request in flight is certain: the fault's own RequestAddress,
// whose body it cuts short (holdRequest), so that the driver waits for the
// rest until it dies; it must end unanswered. Before that it waits (up to
// 5s) for a Docker worker's request in flight too, which may or may not
// still be in flight at the kill: those are counted apart, not asserted.
func (f *faults) restartDriver() {
	deadline := time.Now().Add(5 * time.Second)
	for f.docker.inFlight.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(200 * time.Microsecond)
	}
	held, err := holdRequest(f.drv.sock)
	if err != nil {
		f.fail("driver restart: %v", err)
		return
	}
	defer held.Close()
	worker := f.docker.inFlight.Load() > 0
	if err := f.drv.kill(); err != nil {
		f.fail("%v", err)
		return
	}
	_ = held.SetReadDeadline(time.Now().Add(10 * time.Second))
	buf := make([]byte, 512)
	n, rerr := held.Read(buf)
	if n > 0 || errors.Is(rerr, os.ErrDeadlineExceeded) {
		f.fail("driver restart: the request cut short was answered or still open after the kill: %q, %v", buf[:n], rerr)
		return
	}
	start := time.Now()
	if err := f.drv.start(); err != nil {
		f.fail("driver restart: %v", err)
		return
	}
	f.mu.Lock()
	f.driverRestarts++
	f.midRequest++
	if worker {
		f.workerRequest++
	}
	f.mu.Unlock()
	f.logf("fault: Docker driver SIGKILLed with a request in flight (a worker's too: %v), serving again after %s", worker, time.Since(start).Round(time.Millisecond))
}

// holdRequest sends the driver at sock a RequestAddress whose body is cut
// short: the driver has the request and waits for the rest.
func holdRequest(sock string) (net.Conn, error) {
	c, err := net.DialTimeout("unix", sock, 5*time.Second)
	if err != nil {
		return nil, fmt.Errorf("request to hold: %w", err)
	}
	body := `{"PoolID":"held","Options":{`
	_ = c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	if _, err := fmt.Fprintf(c, "POST /IpamDriver.RequestAddress HTTP/1.1\r\nHost: plugin\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s",
		len(body)+100, body); err != nil {
		c.Close()
		return nil, fmt.Errorf("request to hold: %w", err)
	}
	return c, nil
}
