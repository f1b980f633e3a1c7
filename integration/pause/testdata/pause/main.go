// Command pause is the sandbox ("pause") image of the CRI and Kubernetes suites, built
// static and packed into an image by the test (no registry is reachable).
// Like Kubernetes' pause it waits for SIGTERM or SIGINT (as PID 1 of its
// pod it would otherwise ignore them); unlike it, it also answers on TCP
// port 80 with "pod <hostname>\n", so that traffic published through a
// host port can be traced to the pod that got it.
package main

import (
	"fmt"
	"net"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	name, _ := os.Hostname()
	if l, err := net.Listen("tcp", ":80"); err != nil {
		fmt.Fprintln(os.Stderr, "pause: not serving:", err)
	} else {
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				fmt.Fprintf(c, "pod %s\n", name)
				c.Close()
			}
		}()
	}
	<-stop
}
