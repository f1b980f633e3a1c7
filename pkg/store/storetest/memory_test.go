package storetest_test

import (
	"testing"

	"github.com/ringipam/ringipam/pkg/store"
	"github.com/ringipam/ringipam/pkg/store/memory"
	"github.com/ringipam/ringipam/pkg/store/storetest"
)

// The in-memory store is the reference for the suite itself.
func TestMemory(t *testing.T) {
	storetest.Run(t, func(*testing.T) store.Store { return memory.New() })
}

func BenchmarkMemoryCommit(b *testing.B) { storetest.BenchmarkCommit(b, memory.New()) }
