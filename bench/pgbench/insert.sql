-- The least a lease row costs: a plain insert and delete of a row of the lease table, each its own transaction,
-- neither waiting for its WAL flush. Run it where a lease run made the tables (cd bench && go run . -only lease):
--   PGOPTIONS='-c synchronous_commit=off' pgbench -h 127.0.0.1 -U postgres -n -c 1 -T 5 -M prepared -f bench/pgbench/insert.sql test
INSERT INTO public.advlock_lease (space, key, owner, term, expires) VALUES (1, -7779, 'cost/15000', nextval('public.advlock_fence'), clock_timestamp() + interval '15 s');
DELETE FROM public.advlock_lease WHERE space = 1 AND key = -7779 AND owner = 'cost/15000';
