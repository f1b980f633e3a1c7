// Command cnitime is the churn benchmark's timing shim (integration/churn):
// installed in a CNI_PATH directory under an IPAM plugin's name, it runs the
// real plugin of that name from the directory's .real/ subdirectory with the
// same arguments, environment, stdin, stdout and stderr, and appends one
// line to the directory's timing.log:
//
//	<CNI_COMMAND> <CNI_CONTAINERID> <start, Unix ns> <duration, ns> <exit code>
//
// The duration is the plugin's, from its exec to its exit, as the main
// plugin (bridge) waits for it; the shim's own start-up is not in it. Each
// line is one write on an O_APPEND file, so concurrent invocations do not
// interleave. The plugin's exit code is the shim's; a plugin that cannot be
// started is reported as a CNI error (code 999) on stdout.
package main

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"time"
)

func main() {
	dir, name := filepath.Split(os.Args[0])
	real := filepath.Join(dir, ".real", name)
	cmd := exec.Command(real, os.Args[1:]...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	start := time.Now()
	err := cmd.Run()
	took := time.Since(start)
	code := 0
	var exit *exec.ExitError
	switch {
	case errors.As(err, &exit):
		code = exit.ExitCode()
	case err != nil:
		fmt.Printf(`{"cniVersion":"1.0.0","code":999,"msg":%q}`+"\n", "cnitime: "+err.Error())
		code = 1
	}
	line := fmt.Sprintf("%s %s %d %d %d\n", os.Getenv("CNI_COMMAND"), os.Getenv("CNI_CONTAINERID"), start.UnixNano(), took.Nanoseconds(), code)
	if f, err := os.OpenFile(filepath.Join(dir, "timing.log"), os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644); err == nil {
		f.WriteString(line)
		f.Close()
	}
	os.Exit(code)
}
