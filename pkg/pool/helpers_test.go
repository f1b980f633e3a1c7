package pool

import (
	"os"
	"strconv"
	"testing"

	"github.com/ringipam/ringipam/pkg/hostlock"
)

func hostlockDir(tb testing.TB) hostlock.Dir { return hostlock.Dir(tb.TempDir()) }

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}
