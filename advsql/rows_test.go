package advsql

import (
	"database/sql"
	"slices"
	"testing"
)

// int4Array reads the text form of an int4[] as both drivers hand it to database/sql.
func TestInt4Array(t *testing.T) {
	for _, tc := range []struct {
		in   sql.NullString
		want []int32
		bad  bool
	}{
		{in: sql.NullString{}, want: nil},
		{in: sql.NullString{String: "{}", Valid: true}, want: []int32{}},
		{in: sql.NullString{String: "{42}", Valid: true}, want: []int32{42}},
		{in: sql.NullString{String: "{1,-2,2147483647}", Valid: true}, want: []int32{1, -2, 2147483647}},
		{in: sql.NullString{String: "1,2", Valid: true}, bad: true},
		{in: sql.NullString{String: "{1,NULL}", Valid: true}, bad: true},
		{in: sql.NullString{String: "{2147483648}", Valid: true}, bad: true},
	} {
		got, err := int4Array(&tc.in)
		if (err != nil) != tc.bad || !slices.Equal(got, tc.want) || (tc.want != nil) != (got != nil) {
			t.Errorf("int4Array(%q) = %v, %v", tc.in.String, got, err)
		}
	}
}
