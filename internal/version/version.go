// Package version names the build of every ringipam binary: the release
// (`git describe --tags --always --dirty`) and the commit it was built
// from. The Makefile, scripts/build-image.sh and
// docker-driver/plugin/build.sh stamp both with
//
//	-ldflags "-X github.com/ringipam/ringipam/internal/version.Version=<describe>
//	          -X github.com/ringipam/ringipam/internal/version.Commit=<hash>"
//
// An unstamped build (a plain `go build` or `go test`) reports Version
// "dev" and, when the Go toolchain recorded it (a build inside a git
// checkout), the commit of runtime/debug.ReadBuildInfo's vcs.revision,
// with "-dirty" when vcs.modified says the tree had changes.
//
// Every binary answers `--version` (Requested) with Line; the agent
// also shows Version on /status.json and as the ringipam_build_info metric.
package version

import (
	"fmt"
	"runtime"
	"runtime/debug"
)

// Version and Commit are set at link time (see the package comment).
var (
	Version = ""
	Commit  = ""
)

// Dev is the version of a build that was not stamped.
const Dev = "dev"

// Info is what a binary knows of its build.
type Info struct {
	Version   string `json:"version"`
	Commit    string `json:"commit,omitempty"`
	GoVersion string `json:"goVersion"`
}

// Get returns this binary's build: the stamped values, else "dev" and the
// commit the Go toolchain recorded.
func Get() Info {
	return get(Version, Commit, debug.ReadBuildInfo)
}

func get(version, commit string, read func() (*debug.BuildInfo, bool)) Info {
	in := Info{Version: version, Commit: commit, GoVersion: runtime.Version()}
	if in.Version == "" {
		in.Version = Dev
	}
	if in.Commit != "" {
		return in
	}
	bi, ok := read()
	if !ok {
		return in
	}
	if bi.GoVersion != "" {
		in.GoVersion = bi.GoVersion
	}
	var rev, modified string
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			modified = s.Value
		}
	}
	if rev != "" && modified == "true" {
		rev += "-dirty"
	}
	in.Commit = rev
	return in
}

// Line is the answer to --version: "<program> <version> (commit <hash>,
// <go version>)".
func (in Info) Line(program string) string {
	commit := in.Commit
	if commit == "" {
		commit = "unknown"
	}
	return fmt.Sprintf("%s %s (commit %s, %s)", program, in.Version, commit, in.GoVersion)
}

// Requested reports whether a command line asks for the version: an
// argument "--version" or "-version" before any "--". The binaries check
// it before parsing their flags, so that it works whatever else is given
// (and, for the CNI plugins, without CNI_COMMAND).
func Requested(args []string) bool {
	for _, a := range args {
		if a == "--" {
			return false
		}
		if a == "--version" || a == "-version" {
			return true
		}
	}
	return false
}
