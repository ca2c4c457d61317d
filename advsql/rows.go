package advsql

import (
	"context"
	"database/sql"
	"fmt"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// querier gives a Locker over db the advlock.Querier that its Inspect, Leader and LockTable read through: each
// query on a connection of db, its rows read through database/sql, with either driver.
type querier struct{ db *sql.DB }

func (q querier) Query(ctx context.Context, query string, args ...any) (pgx.Rows, error) {
	rows, err := q.db.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	return &sqlRows{rows: rows}, nil
}

// sqlRows is the part of pgx.Rows that advlock's readers use (Next, Scan, Err, Close, Values), over *sql.Rows.
// database/sql scans what these queries return, except an int4[] into a *[]int32, which both drivers hand over as
// text ("{1,2}"): sqlRows reads that itself.
type sqlRows struct {
	rows *sql.Rows
	err  error // Close's, or a scan's
}

func (r *sqlRows) Close() {
	if err := r.rows.Close(); err != nil && r.err == nil {
		r.err = err
	}
}

func (r *sqlRows) Err() error {
	if err := r.rows.Err(); err != nil {
		return err
	}
	return r.err
}

func (r *sqlRows) CommandTag() pgconn.CommandTag                { return pgconn.CommandTag{} }
func (r *sqlRows) FieldDescriptions() []pgconn.FieldDescription { return nil }
func (r *sqlRows) Next() bool                                   { return r.rows.Next() }
func (r *sqlRows) RawValues() [][]byte                          { return nil }
func (r *sqlRows) Conn() *pgx.Conn                              { return nil }
func (r *sqlRows) TypeMap() *pgtype.Map                         { return nil } // database/sql decodes the values

func (r *sqlRows) Scan(dest ...any) error {
	dest = append([]any(nil), dest...)
	arrays := map[int]*[]int32{}
	texts := map[int]*sql.NullString{}
	for i, d := range dest {
		if a, ok := d.(*[]int32); ok {
			arrays[i], texts[i] = a, new(sql.NullString)
			dest[i] = texts[i]
		}
	}
	if err := r.rows.Scan(dest...); err != nil {
		return err
	}
	for i, a := range arrays {
		v, err := int4Array(texts[i])
		if err != nil {
			return fmt.Errorf("column %d: %w", i, err)
		}
		*a = v
	}
	return nil
}

func (r *sqlRows) Values() ([]any, error) {
	cols, err := r.rows.Columns()
	if err != nil {
		return nil, err
	}
	vals := make([]any, len(cols))
	ptrs := make([]any, len(cols))
	for i := range vals {
		ptrs[i] = &vals[i]
	}
	return vals, r.rows.Scan(ptrs...)
}

// int4Array reads the text form of a one-dimensional int4[] without NULLs ("{}", "{1,2}"); NULL gives nil.
func int4Array(s *sql.NullString) ([]int32, error) {
	if !s.Valid {
		return nil, nil
	}
	inner, ok1 := strings.CutPrefix(s.String, "{")
	inner, ok2 := strings.CutSuffix(inner, "}")
	if !ok1 || !ok2 {
		return nil, fmt.Errorf("not an int4[]: %q", s.String)
	}
	out := []int32{}
	if inner == "" {
		return out, nil
	}
	for f := range strings.SplitSeq(inner, ",") {
		n, err := strconv.ParseInt(f, 10, 32)
		if err != nil {
			return nil, fmt.Errorf("not an int4[]: %q", s.String)
		}
		out = append(out, int32(n))
	}
	return out, nil
}
