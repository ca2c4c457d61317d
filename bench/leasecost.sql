-- What a lease cycle costs inside the server, without the network: 5,000 cycles of each, every statement
-- committed on its own, none waiting for its WAL flush (as advlock's grants and releases). Run it where a lease run
-- (cd bench && go run . -only lease) made the tables and functions:
--   psql -h 127.0.0.1 -U postgres test -f bench/leasecost.sql
-- The functions' names carry a version (grantFunc and releaseFunc in internal/lease/sql.go): change them here with it.
SET synchronous_commit = off;
\timing on
\echo advisory lock and unlock
DO $$ BEGIN FOR i IN 1..5000 LOOP PERFORM pg_try_advisory_lock(-7777); COMMIT; PERFORM pg_advisory_unlock(-7777); COMMIT; END LOOP; END $$;
\echo insert and delete of a lease row, the work of the raw lease loop
DO $$ BEGIN FOR i IN 1..5000 LOOP
  INSERT INTO public.advlock_lease (space, key, owner, term, expires) VALUES (1, -7777, 'cost/15000', nextval('public.advlock_fence'), clock_timestamp() + interval '15 s'); COMMIT;
  DELETE FROM public.advlock_lease WHERE space = 1 AND key = -7777; COMMIT;
END LOOP; END $$;
\echo the grant and release functions (a try)
DO $$ DECLARE t text; BEGIN FOR i IN 1..5000 LOOP
  t := split_part(public.advlock_lease_grant_v6(1, -7777, 'cost/15000', '', 15000, '', 0, 0, 0), ' ', 2); COMMIT;
  PERFORM public.advlock_lease_release_v1(1, -7777, 'cost/15000', t::int8); COMMIT;
END LOOP; END $$;
