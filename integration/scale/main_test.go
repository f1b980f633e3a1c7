//go:build integration || scale

package scale_test

import (
	"testing"

	"github.com/ringipam/ringipam/integration/scale/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }
