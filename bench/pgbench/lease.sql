-- A lease cycle's two statements as advlock sends them (literal calls of the grant and release functions over the
-- simple protocol), with nothing of a Go client around them. The functions' names carry a version (grantFunc and
-- releaseFunc in internal/lease/sql.go): change them here with it.
--   pgbench -h 127.0.0.1 -U postgres -n -c 1 -T 5 -M simple -f bench/pgbench/lease.sql test
SELECT split_part(public.advlock_lease_grant_v6(1, -7778, E'0123456789abcdef0123456789abcdef/15000', E'pgbench', 15000, E'', 0, 0, 4000000000000000), ' ', 2) AS term \gset
SELECT public.advlock_lease_release_v1(1, -7778, E'0123456789abcdef0123456789abcdef/15000', :term);
