//go:build integration

// Package pause makes the integration suites' pause image without a
// registry: it builds the static binary of testdata/pause (which waits for
// SIGTERM and answers TCP port 80 with "pod <hostname>") and packs it into
// a docker-archive tarball tagged Image, which `ctr images import` reads.
// A node's containerd names Image as its sandbox_image; the Kubernetes
// suite also runs it as its pods' container.
//
// Contract: only integration-tagged tests import it. Build is safe for
// concurrent use with distinct directories.
package pause

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"runtime"

	"github.com/ringipam/ringipam/integration/cnitest"
)

// Image is the tag of the image Build writes.
const Image = "ringipam.test/pause:1"

// Build builds the pause binary into dir and writes the image archive
// beside it; it returns the archive's path.
func Build(ctx context.Context, dir string) (string, error) {
	bin := filepath.Join(dir, "pause")
	build := cnitest.GoCommand(ctx, cnitest.RepoRoot, "build", "-trimpath", "-o", bin, "./integration/pause/testdata/pause")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		return "", fmt.Errorf("building pause: %v: %s", err, out)
	}
	archive := filepath.Join(dir, "pause.tar")
	return archive, writeImageArchive(archive, bin, Image)
}

// writeImageArchive writes a docker-archive tarball (what `docker save`
// writes and `ctr images import` reads) of a one-layer image tagged tag
// whose only file is the executable bin at /pause, its entrypoint.
func writeImageArchive(path, bin, tag string) error {
	exe, err := os.ReadFile(bin)
	if err != nil {
		return err
	}
	var layer bytes.Buffer
	if err := writeTar(&layer, []tarFile{{name: "pause", mode: 0o755, data: exe}}); err != nil {
		return err
	}
	layerSum := sha256.Sum256(layer.Bytes())
	layerID := hex.EncodeToString(layerSum[:])
	cfg, err := json.Marshal(map[string]any{
		"architecture": runtime.GOARCH,
		"os":           "linux",
		"config":       map[string]any{"Entrypoint": []string{"/pause"}},
		"rootfs":       map[string]any{"type": "layers", "diff_ids": []string{"sha256:" + layerID}},
	})
	if err != nil {
		return err
	}
	cfgSum := sha256.Sum256(cfg)
	cfgName := hex.EncodeToString(cfgSum[:]) + ".json"
	manifest, err := json.Marshal([]map[string]any{{
		"Config":   cfgName,
		"RepoTags": []string{tag},
		"Layers":   []string{layerID + "/layer.tar"},
	}})
	if err != nil {
		return err
	}
	var out bytes.Buffer
	if err := writeTar(&out, []tarFile{
		{name: layerID + "/", mode: 0o755, dir: true},
		{name: layerID + "/layer.tar", mode: 0o644, data: layer.Bytes()},
		{name: cfgName, mode: 0o644, data: cfg},
		{name: "manifest.json", mode: 0o644, data: manifest},
	}); err != nil {
		return err
	}
	return os.WriteFile(path, out.Bytes(), 0o644)
}

type tarFile struct {
	name string
	mode int64
	dir  bool
	data []byte
}

func writeTar(w *bytes.Buffer, files []tarFile) error {
	tw := tar.NewWriter(w)
	for _, f := range files {
		h := &tar.Header{Name: f.name, Mode: f.mode, Typeflag: tar.TypeReg, Size: int64(len(f.data)), Format: tar.FormatPAX}
		if f.dir {
			h.Typeflag, h.Size = tar.TypeDir, 0
		}
		if err := tw.WriteHeader(h); err != nil {
			return fmt.Errorf("tar %s: %w", f.name, err)
		}
		if _, err := tw.Write(f.data); err != nil {
			return fmt.Errorf("tar %s: %w", f.name, err)
		}
	}
	return tw.Close()
}
