package ipam

import (
	"encoding/json"
	"path/filepath"
	"testing"

	"github.com/containernetworking/cni/libcni"
)

// TestExampleConfLists loads every ipam-ring entry of conf/*.conflist the
// way the plugin receives it (plugin config with name and cniVersion).
func TestExampleConfLists(t *testing.T) {
	files, err := filepath.Glob("../../../conf/*.conflist")
	if err != nil || len(files) == 0 {
		t.Fatalf("no example conflists found: %v", err)
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			list, err := libcni.ConfListFromFile(f)
			if err != nil {
				t.Fatal(err)
			}
			n := 0
			for _, p := range list.Plugins {
				var probe struct {
					IPAM struct {
						Type string `json:"type"`
					} `json:"ipam"`
				}
				if err := json.Unmarshal(p.Bytes, &probe); err != nil {
					t.Fatal(err)
				}
				if probe.IPAM.Type != "ipam-ring" {
					continue
				}
				n++
				var m map[string]any
				if err := json.Unmarshal(p.Bytes, &m); err != nil {
					t.Fatal(err)
				}
				m["name"], m["cniVersion"] = list.Name, list.CNIVersion
				b, _ := json.Marshal(m)
				if _, err := Load(b, ""); err != nil {
					t.Errorf("plugin %s: %v", p.Network.Type, err)
				}
			}
			if n == 0 {
				t.Error("no ipam-ring plugin in the example")
			}
		})
	}
}
