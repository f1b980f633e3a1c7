package routes

import "testing"

func TestTableConfigComplete(t *testing.T) {
	got, err := TableConfig{}.Complete()
	if err != nil || got != (TableConfig{Table: DefaultTable, Protocol: DefaultProtocol, RulePriority: DefaultRulePriority}) {
		t.Fatalf("zero config: %+v, %v", got, err)
	}
	for _, bad := range []TableConfig{{Table: 254}, {Table: 255}, {Table: 253}, {Table: -1}, {Protocol: 4}, {Protocol: 256}, {RulePriority: 32766}, {RulePriority: -5}} {
		if _, err := bad.Complete(); err == nil {
			t.Errorf("%+v: no error", bad)
		}
	}
}
