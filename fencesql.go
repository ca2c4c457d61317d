package advlock

import "github.com/advlock/advlock/internal/session"

// FenceSQL creates, in the current schema, what a resource written in SQL needs to check fencing tokens: a table of
// the largest token each resource accepted, and a function advlock_fence(resource, token) that accepts token when
// it is at least that large (the same holder may write again with its token), records it, and says whether it
// was accepted. Call it inside the transaction that writes the resource, and write only when it returns true: the
// row it updates stays locked until that transaction ends, so two holders never both pass with writes in between.
//
//	BEGIN;
//	SELECT advlock_fence('invoice-42', $1);        -- $1 = lk.Token(); false: a later holder wrote, give up
//	UPDATE invoices SET state = 'sent' WHERE id = 42; -- only when it said true
//	COMMIT;
//
// Tokens compare across failovers too (see [WithFencing]): a deposed primary's holder is refused once a holder of
// the promoted one wrote. Run it once, as a role that may create tables and functions there (it is idempotent).
const FenceSQL = `CREATE TABLE IF NOT EXISTS advlock_fences (resource text PRIMARY KEY, token bigint NOT NULL);
CREATE OR REPLACE FUNCTION advlock_fence(resource text, token bigint) RETURNS boolean LANGUAGE sql AS $$
  WITH f AS (
    INSERT INTO advlock_fences AS f (resource, token) VALUES (resource, token)
    ON CONFLICT ON CONSTRAINT advlock_fences_pkey DO UPDATE SET token = excluded.token WHERE f.token <= excluded.token
    RETURNING 1)
  SELECT EXISTS (SELECT 1 FROM f)
$$;`

// FenceTokenSQL is an SQL expression that draws a fencing token inside a transaction, comparable with the tokens of
// [WithFencing]'s grants (the server's timeline in the high bits, the next value of the sequence
// public.advlock_fence in the low ones): a holder of a transaction-scoped lock ([XactLock], [Locker.DoTx]), which
// carries no token, draws one with "SELECT " + FenceTokenSQL, after the lock, and writes with it in the same
// transaction. The plain nextval of the sequence is not one: it is far below every grant's token. The sequence must
// exist (a Locker with WithFencing creates it on first use).
const FenceTokenSQL = session.TokenSQL
