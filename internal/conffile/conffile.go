// Package conffile reads the JSON configuration file of a long-running
// ringipam command (the host agent, the Docker driver): which file (the
// --config flag, else an environment variable), and its strict decoding
// over the command's defaults.
//
// Contract: Path only looks at args for --config (both "--config F" and
// "--config=F", one or two dashes) and never fails: the command's own flag
// set parses args afterwards and reports anything wrong with them. Decode
// leaves into untouched when path is empty, refuses unknown keys, and
// names the file in its errors.
package conffile

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"strings"
)

// Path returns the configuration file args name with --config, or fromEnv
// when they name none.
func Path(args []string, fromEnv string) string {
	path := fromEnv
	for i, a := range args {
		name, val, hasVal := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if !strings.HasPrefix(a, "-") || name != "config" {
			continue
		}
		if hasVal {
			path = val
		} else if i+1 < len(args) {
			path = args[i+1]
		}
	}
	return path
}

// Decode reads the JSON file at path into into, refusing keys into does
// not have. An empty path reads nothing.
func Decode(path string, into any) error {
	if path == "" {
		return nil
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(into); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	return nil
}
