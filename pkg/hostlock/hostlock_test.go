package hostlock

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"
)

func TestLockIsExclusiveAndHasADeadline(t *testing.T) {
	d := Dir(t.TempDir())
	unlock, err := d.Lock(context.Background(), "p")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if _, err := d.Lock(ctx, "p"); !errors.Is(err, ErrTimeout) {
		t.Fatalf("second lock while held: %v, want ErrTimeout", err)
	}
	other, err := d.Lock(context.Background(), "q")
	if err != nil {
		t.Fatalf("a different name must not wait: %v", err)
	}
	other()
	unlock()
	again, err := d.Lock(context.Background(), "p")
	if err != nil {
		t.Fatalf("lock after release: %v", err)
	}
	again()
}

func TestLockSerialises(t *testing.T) {
	d := Dir(t.TempDir())
	var mu sync.Mutex
	inside, maxInside := 0, 0
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 20 {
				unlock, err := d.Lock(context.Background(), "p")
				if err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				inside++
				maxInside = max(maxInside, inside)
				mu.Unlock()
				time.Sleep(50 * time.Microsecond)
				mu.Lock()
				inside--
				mu.Unlock()
				unlock()
			}
		}()
	}
	wg.Wait()
	if maxInside != 1 {
		t.Fatalf("%d holders at once", maxInside)
	}
}

func TestBadNames(t *testing.T) {
	if _, err := Dir("").Lock(context.Background(), "p"); err == nil {
		t.Fatal("empty dir accepted")
	}
	if _, err := Dir(t.TempDir()).Lock(context.Background(), "a/b"); err == nil {
		t.Fatal("name with / accepted")
	}
}
