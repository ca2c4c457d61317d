package session

import (
	"context"
	"encoding/hex"
	"fmt"
	"strconv"
	"time"
)

// NamesTable holds the names of the keys Lead campaigns for, written once per Locker and name, so that advlock ls
// can show a leader's key by its name: a key is a hash of its name, and a lock carries no text.
const NamesTable = "public.advlock_names"

// NamesSQL creates NamesTable.
const NamesSQL = "CREATE TABLE IF NOT EXISTS " + NamesTable + " (key bigint PRIMARY KEY, name text NOT NULL)"

// MaxPublishedName is the longest name, in bytes, that PublishName writes.
const MaxPublishedName = 1024

// PublishName writes name as the name of the int8 key v to NamesTable, creating the table when it is missing,
// through one connection of pool, within bound. A row already there for v is left as it is (a write only the
// first time). It says what trying again cannot mend: badName, the name is not text the database can hold (not
// UTF-8, a NUL, a character its encoding lacks); noRole, the role may not create or write the table, or there is
// no schema public.
func PublishName(ctx context.Context, pool Pool, v int64, name string, bound time.Duration) (badName, noRole bool, err error) {
	ctx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return false, false, fmt.Errorf("acquire connection: %w", err)
	}
	// The name goes as hex digits, which read the same whatever the server's settings and encoding.
	// It waits for a row lock at most 1 s, and its commit for no flush and no standby: a name is for people.
	insert := "SELECT set_config('lock_timeout', '1000', true), set_config('synchronous_commit', 'off', true);\nINSERT INTO " + NamesTable + " (key, name) VALUES (" + strconv.FormatInt(v, 10) +
		", convert_from(decode('" + hex.EncodeToString([]byte(name)) + "', 'hex'), 'UTF8')) ON CONFLICT (key) DO NOTHING; SELECT 1"
	for attempt := 0; ; attempt++ {
		_, err = conn.QueryInt(ctx, insert)
		if SQLState(err) == "42P01" && attempt < 3 { // no table yet: a database that never had a leader
			_, err = conn.QueryInt(ctx, NamesSQL+"; SELECT 1")
			switch code := SQLState(err); {
			case err == nil:
				continue
			case (code == "23505" || code == "42P07" || code == "42710") && attempt < 3:
				continue // created by another client at the same moment: it is there now
			}
		}
		break
	}
	code := SQLState(err)
	if err == nil || code != "" {
		conn.Release() // it answered, and holds nothing
	} else {
		conn.Destroy()
	}
	switch code {
	case "22021", "22P05":
		return true, false, err
	case "42501", "3F000":
		return false, true, err
	}
	return false, false, err
}
