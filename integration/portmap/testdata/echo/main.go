// Command echo is the test workload of the portmap suite: as a server it
// echoes TCP lines and UDP datagrams; as a client (-dial) it sends one
// message and prints the answer.
package main

import (
	"bufio"
	"flag"
	"fmt"
	"net"
	"os"
	"time"
)

func main() {
	tcp := flag.String("tcp", "", "serve TCP echo on this address")
	udp := flag.String("udp", "", "serve UDP echo on this address")
	dial := flag.String("dial", "", "client: network/address, e.g. tcp/198.18.0.1:8080")
	msg := flag.String("msg", "hello", "client: message")
	flag.Parse()
	if *dial != "" {
		if err := client(*dial, *msg); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		return
	}
	if *tcp != "" {
		l, err := net.Listen("tcp", *tcp)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				go func() {
					defer c.Close()
					line, _ := bufio.NewReader(c).ReadString('\n')
					fmt.Fprint(c, "echo "+line)
				}()
			}
		}()
	}
	if *udp != "" {
		pc, err := net.ListenPacket("udp", *udp)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		go func() {
			buf := make([]byte, 2048)
			for {
				n, from, err := pc.ReadFrom(buf)
				if err != nil {
					return
				}
				pc.WriteTo(append([]byte("echo "), buf[:n]...), from)
			}
		}()
	}
	select {}
}

func client(target, msg string) error {
	network, addr := target[:3], target[4:]
	c, err := net.DialTimeout(network, addr, 5*time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := fmt.Fprintln(c, msg); err != nil {
		return err
	}
	buf := make([]byte, 256)
	n, err := c.Read(buf)
	if err != nil {
		return err
	}
	fmt.Print(string(buf[:n]))
	return nil
}
