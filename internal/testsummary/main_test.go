package main

import (
	"strings"
	"testing"
)

func TestSummaryFailsASuiteThatOnlySkipped(t *testing.T) {
	in := strings.Join([]string{
		`{"Action":"run","Package":"m/integration/cni","Test":"TestA"}`,
		`{"Action":"output","Package":"m/integration/cni","Test":"TestA","Output":"--- SKIP: TestA (0.00s)\n"}`,
		`{"Action":"skip","Package":"m/integration/cni","Test":"TestA"}`,
		`{"Action":"pass","Package":"m/integration/cni"}`,
		`{"Action":"run","Package":"m/pkg/pool","Test":"TestB"}`,
		`{"Action":"pass","Package":"m/pkg/pool","Test":"TestB"}`,
		`{"Action":"output","Package":"m/integration/netns","Output":"?   \tm/integration/netns\t[no test files]\n"}`,
		`{"Action":"skip","Package":"m/integration/netns"}`,
	}, "\n")
	var out strings.Builder
	code, err := summarize(strings.NewReader(in), &out, "/integration/")
	if err != nil || code != 1 {
		t.Fatalf("code %d, %v; want 1\n%s", code, err, out.String())
	}
	for _, want := range []string{"m/integration/cni", "0 passed", "1 skipped", "ran no test", "m/pkg/pool"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("summary lacks %q:\n%s", want, out.String())
		}
	}
	if strings.Contains(out.String(), "m/integration/netns ") {
		t.Errorf("a package with no test files is listed:\n%s", out.String())
	}
}

func TestSummaryPassesWhenSuitesRan(t *testing.T) {
	in := `{"Action":"run","Package":"m/integration/cni","Test":"TestA"}
{"Action":"pass","Package":"m/integration/cni","Test":"TestA"}
{"Action":"run","Package":"m/integration/cni","Test":"TestA/sub"}
{"Action":"skip","Package":"m/integration/cni","Test":"TestA/sub"}
{"Action":"pass","Package":"m/integration/cni"}`
	var out strings.Builder
	if code, err := summarize(strings.NewReader(in), &out, "/integration/"); err != nil || code != 0 {
		t.Fatalf("code %d, %v\n%s", code, err, out.String())
	}
	if !strings.Contains(out.String(), "1 passed   0 failed   0 skipped") {
		t.Errorf("summary:\n%s", out.String())
	}
}

func TestSummaryFailsOnAFailedPackage(t *testing.T) {
	in := `{"Action":"output","Package":"m/integration/cni","Output":"FAIL: suite cni needs root\n"}
{"Action":"fail","Package":"m/integration/cni"}`
	var out strings.Builder
	if code, _ := summarize(strings.NewReader(in), &out, "/integration/"); code != 1 {
		t.Fatalf("code %d\n%s", code, out.String())
	}
}
