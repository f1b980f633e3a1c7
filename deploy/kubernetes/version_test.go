package kubernetes

import (
	"bufio"
	"bytes"
	"os"
	"regexp"
	"strings"
	"testing"
)

// release is a release tag: vMAJOR.MINOR.PATCH, optionally -rc.N.
var release = regexp.MustCompile(`^v[0-9]+\.[0-9]+\.[0-9]+(-rc\.[0-9]+)?$`)

// newestRelease is the first "## vX.Y.Z" heading of CHANGELOG.md (the
// "Unreleased" section above it is not a release).
func newestRelease(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("../../CHANGELOG.md")
	if err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		if h, ok := strings.CutPrefix(sc.Text(), "## "); ok {
			if v := strings.Fields(h)[0]; release.MatchString(v) {
				return v
			}
		}
	}
	t.Fatal("CHANGELOG.md names no release (a heading ## vX.Y.Z)")
	return ""
}

// TestManifestPinsRelease: both containers run ringipam/ringipam at a
// release tag (never :dev, :latest or a commit), the newest release of
// CHANGELOG.md, the tag `make image` gives the image built at that
// release's git tag (scripts/version.sh: git describe).
func TestManifestPinsRelease(t *testing.T) {
	m := loadManifest(t, readManifest(t))
	want := "ringipam/ringipam:" + newestRelease(t)
	spec := m.ds.Spec.Template.Spec
	for _, c := range append(spec.InitContainers, spec.Containers...) {
		tag, ok := strings.CutPrefix(c.Image, "ringipam/ringipam:")
		switch {
		case !ok:
			t.Errorf("container %s: image %q is not ringipam/ringipam", c.Name, c.Image)
		case !release.MatchString(tag):
			t.Errorf("container %s: image %q is not pinned to a release (vX.Y.Z)", c.Name, c.Image)
		case c.Image != want:
			t.Errorf("container %s: image %q, want the newest release of CHANGELOG.md, %s", c.Name, c.Image, want)
		}
	}
}
