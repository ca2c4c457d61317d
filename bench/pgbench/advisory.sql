-- A raw advisory lock and unlock, the reference of the other scripts here (see docs/performance.md):
--   pgbench -h 127.0.0.1 -U postgres -n -c 1 -T 5 -M simple -f bench/pgbench/advisory.sql test
SELECT pg_try_advisory_lock(-7778);
SELECT pg_advisory_unlock(-7778);
