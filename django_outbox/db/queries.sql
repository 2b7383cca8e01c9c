-- The package's vendor SQL, one named query per section, loaded by
-- django_outbox.db.queries.sql(name, ...). A section starts at its
-- "-- name: NAME" line; the comment lines after it say what it does.
--
-- Placeholders in braces are filled in by the loader: {table}-like names as
-- quoted identifiers, status values and channels as quoted literals, {rows} as
-- a fragment built from another named query. %s are the driver's parameters.
--
-- A migration never uses these: it keeps a frozen copy of the SQL it installs.


-- name: claim
-- PostgreSQL: pick due rows through outbox_due_idx with SKIP LOCKED (expired
-- leases included: reclaim), keep the oldest whose payload text adds up to the
-- byte bound (the first always), lease them and return them. Parameters:
-- limit, max_bytes, lease seconds (twice), worker, token. The columns returned
-- are named after ClaimedMessage's fields.
WITH picked AS (
    SELECT id, available_at, octet_length(payload::text) AS size FROM {table}
    WHERE status IN ({claimable}) AND available_at <= now() AND sequence IS NULL
    ORDER BY available_at, id
    LIMIT %s
    FOR UPDATE SKIP LOCKED
), running AS (
    SELECT id, row_number() OVER w AS n, sum(size) OVER w AS total FROM picked
    WINDOW w AS (ORDER BY available_at, id)
), bounded AS (
    SELECT id FROM running WHERE n = 1 OR total <= %s
)
UPDATE {table} AS o
SET status = {processing},
    available_at = now() + make_interval(secs => %s),
    locked_until = now() + make_interval(secs => %s),
    locked_by = %s,
    lease_token = %s
FROM bounded
WHERE o.id = bounded.id
RETURNING o.id AS id, o.event_id AS event_id, o.event_type AS event_type,
          o.destination AS destination, o.payload::text AS payload,
          o.headers::text AS headers, o.ordering_key AS ordering_key,
          o.attempts AS attempts, o.created_at AS created_at,
          o.sequence AS sequence, o.skipped_at IS NOT NULL AS skipped


-- name: insert
-- PostgreSQL: stage new rows in one statement; {rows} is insert_row repeated
-- once per row. Returns what the database filled in.
INSERT INTO {table} (event_id, event_type, destination, payload, headers,
                     ordering_key, available_at, status, attempts, locked_by, last_error)
VALUES {rows}
RETURNING event_id, id, available_at, created_at


-- name: insert_row
-- PostgreSQL: one new row of insert (parameters: event_id, event_type,
-- destination, payload, headers, ordering_key, available_at or NULL).
(%s, %s, %s, %s::jsonb, %s::jsonb, %s, coalesce(%s, statement_timestamp()), {pending}, 0, '', '')


-- name: listen
-- PostgreSQL: wait for the notifications of notify_function.
LISTEN {channel}


-- name: notify_function
-- PostgreSQL: the function notify_trigger runs. PostgreSQL delivers the
-- notification when (and only if) the staging transaction commits, and folds
-- repeats within one transaction into one. Current definition: migrations keep
-- their own frozen copy (tests check they match).
CREATE OR REPLACE FUNCTION django_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify({channel}, TG_TABLE_NAME);
    RETURN NULL;
END
$$


-- name: notify_trigger
-- PostgreSQL: a statement-level trigger, so that staging N events costs one
-- NOTIFY and no extra round trip.
CREATE TRIGGER django_outbox_notify AFTER INSERT ON {table} FOR EACH STATEMENT EXECUTE FUNCTION django_outbox_notify()
