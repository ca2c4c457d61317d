package cli

import "testing"

func TestCount(t *testing.T) {
	for _, tc := range []struct {
		n    int
		want string
	}{{0, "0 leases"}, {1, "1 lease"}, {2, "2 leases"}} {
		if got := count(tc.n, "lease", "leases"); got != tc.want {
			t.Errorf("count(%d) = %q, want %q", tc.n, got, tc.want)
		}
	}
}
