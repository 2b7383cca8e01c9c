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
-- PostgreSQL: one statement for a batch of unordered and ordered rows, oldest
-- first (expired leases included: reclaim). Unordered rows (no sequence) come
-- through outbox_due_idx; ordered rows are the heads of their keys (the gate
-- ordered_gate, through outbox_ordered_due_idx) and, after each head, the run
-- of its key's next rows in sequence order (through outbox_key_unfinished_idx)
-- for as long as they are due and contiguous. Every row is locked with SKIP
-- LOCKED where the table is read, so PostgreSQL re-checks status and lease on
-- its newest version. The batch is cut to limit rows and max_bytes of payload
-- text (the first row always) in an order that keeps each key's prefix: heads
-- and unordered rows by age, then the runs' first rows, their second rows, ...
-- Each head's run is capped so that the heads' runs together about fill the
-- batch. Due is the fragment claim_due (in the run's subquery its columns are
-- the later row's), the payload's text or size claim_payload. Parameters: limit
-- (four times), max_bytes, lease seconds, worker, token. Its parts shared with
-- claim_unordered are the fragments claim_unordered_rows, claim_bounded and
-- claim_lease.
WITH picked AS (
    {unordered_rows}
), heads AS (
    SELECT id, available_at, destination, ordering_key, sequence, {payload}
    FROM {table} AS head
    WHERE {due} AND sequence IS NOT NULL AND {ordered_gate}
    ORDER BY available_at, id
    LIMIT %s
    FOR UPDATE SKIP LOCKED
), runs AS (
    SELECT run.id, head.available_at, head.id AS head_id, run.body, run.large,
           run.sequence - head.sequence AS place,
           row_number() OVER (PARTITION BY head.id ORDER BY run.sequence) AS n
    FROM heads AS head CROSS JOIN LATERAL (
        SELECT later.id, later.sequence, {later_payload}
        FROM {table} AS later
        WHERE later.destination = head.destination
          AND later.ordering_key = head.ordering_key
          AND later.sequence > head.sequence AND {due}
        ORDER BY later.sequence
        LIMIT (SELECT ceil(greatest(%s - count(*), 0) / greatest(count(*), 1)::numeric)
               FROM heads)
        FOR UPDATE SKIP LOCKED
    ) AS run
), candidates AS (
    SELECT id, 0 AS place, available_at, id AS head_id, body, large FROM picked
    UNION ALL
    SELECT id, 0, available_at, id, body, large FROM heads
    UNION ALL
    SELECT id, place, available_at, head_id, body, large FROM runs WHERE place = n
), running AS (
    SELECT id, body, row_number() OVER w AS n,
           sum(coalesce(octet_length(body), large)) OVER w AS total
    FROM candidates
    WINDOW w AS (ORDER BY place, available_at, head_id)
), bounded AS (
    {bounded}
)
{lease}


-- name: claim_unordered
-- PostgreSQL: the claim of the unordered rows alone (ordered rows are left as they
-- are), for a relay whose settings order no route, between its whole claims:
-- PostgreSQL plans it in about a third of the time (a millisecond less per claim
-- here). Parameters: limit (twice), max_bytes, lease seconds, worker, token.
WITH picked AS (
    {unordered_rows}
), running AS (
    SELECT id, body, row_number() OVER w AS n,
           sum(coalesce(octet_length(body), large)) OVER w AS total
    FROM picked
    WINDOW w AS (ORDER BY available_at, id)
), bounded AS (
    {bounded}
)
{lease}


-- name: claim_commit_unflushed
-- PostgreSQL, sent before claim_unordered in the same simple-protocol query (one
-- implicit transaction): the claim's commit does not wait for its WAL flush (about
-- 0.6 ms per claim here). A claim a crash loses leaves its rows due, to be claimed
-- and published again: duplicates, as at-least-once allows. Never before the whole
-- claim: a lost lease on an ordered key would let a second relay publish the key
-- while the first one still does.
SET LOCAL synchronous_commit = off


-- name: claim_without_jit
-- PostgreSQL, sent before either claim in the same simple-protocol query (one
-- implicit transaction): no JIT compilation of the claim. The planner's cost of
-- the claim's runs grows with the ordered rows it expects (with a million events
-- scheduled ahead, 100,000 of them ordered, it passed jit_above_cost), and JIT
-- then compiled every claim: 74 ms of an 80 ms claim of 500 rows whose plan ran
-- in 6. A claim is short, run often, and never worth compiling.
SET LOCAL jit = off


-- name: claim_unordered_rows
-- PostgreSQL, a fragment of claim and claim_unordered: the due unordered rows,
-- oldest first, locked (parameter: limit), with their payload's text or its size
-- (claim_payload).
SELECT id, available_at, {payload}
FROM {table}
WHERE {due} AND sequence IS NULL
ORDER BY available_at, id
LIMIT %s
FOR UPDATE SKIP LOCKED


-- name: claim_payload
-- PostgreSQL, a fragment of the claims' picks: of the payload column {payload},
-- when stored in up to 2 KiB and uncompressed, its text ("body": the bounds count
-- it and the claim returns it, so it is written once); else its text's size
-- ("large": its text is written again for the rows leased, so that a pick of 500
-- large payloads does not hold them all, in memory or in temporary files).
CASE WHEN pg_column_size({payload}) <= 2048 AND pg_column_compression({payload}) IS NULL
     THEN {payload}::text END AS body,
CASE WHEN pg_column_size({payload}) > 2048 OR pg_column_compression({payload}) IS NOT NULL
     THEN octet_length({payload}::text) END AS large


-- name: claim_due
-- PostgreSQL, a boolean fragment of the claims and of backlog_oldest_due: the
-- row is due at {clock} (a claim's now(), a scrape's statement_timestamp()).
-- PENDING and FAILED rows whose available_at has come, PROCESSING ones whose
-- lease (locked_until) ran out. Unfinished as the due indexes say it (no
-- published_at, no abandoned_at), so that one of them is read: a claim leaves
-- available_at and these columns alone (a HOT update), so the rows in flight
-- stay in the index and are passed over by their lease. {window} is empty, or in
-- a relay's claim on a partitioned outbox the ids it reads (claim_window).
status IN ({claimable}) AND published_at IS NULL AND abandoned_at IS NULL
AND available_at <= {clock}
AND (status <> {processing} OR locked_until IS NULL OR locked_until <= {clock}){window}


-- name: claim_bounded
-- PostgreSQL, a fragment of claim and claim_unordered: the numbered candidates
-- ("running") cut to limit rows and max_bytes of payload text, the first row
-- always (parameters: limit, max_bytes), with what claim_lease needs of them.
SELECT id, body FROM running WHERE n <= %s AND (n = 1 OR total <= %s)


-- name: claim_lease
-- PostgreSQL, the end of claim and claim_unordered: lease the rows of "bounded"
-- and return them (parameters: lease seconds, worker, token). It writes no
-- column an index names, so PostgreSQL updates each row in place on its page
-- (HOT: no index entry); available_at stays, the lease is locked_until. A small
-- payload is the text the pick wrote for the byte bound (written once, not twice:
-- about 1 µs a row less in EXPLAIN ANALYZE of a 500-row claim). Each row is found by
-- its id, not by the ctid its pick locked: a row another transaction updated after
-- this statement's snapshot is locked (and re-checked) in its newest version, whose
-- ctid the snapshot cannot see, so a TID scan would leave it out. The columns
-- are named after ClaimedMessage's fields; created_at as microseconds since the
-- epoch (see postgresql.claim); considered, the same in every row, counts the
-- rows the claim picked before its row and byte bounds (more than it returns:
-- it left due rows behind); next_due_in, the same in every row, is next_due at
-- the claim's now() (the relay's rest after the batch waits no longer).
UPDATE {table} AS o
SET status = {processing},
    locked_until = now() + make_interval(secs => %s),
    locked_by = %s,
    lease_token = %s
FROM bounded
WHERE o.id = bounded.id{lease_window}
RETURNING o.id AS id, o.event_id AS event_id, o.event_type AS event_type,
          o.destination AS destination, coalesce(bounded.body, o.payload::text) AS payload,
          o.headers::text AS headers, o.ordering_key AS ordering_key,
          o.attempts AS attempts,
          (extract(epoch FROM o.created_at) * 1000000)::bigint AS created_at,
          o.sequence AS sequence, o.skipped_at IS NOT NULL AS skipped,
          (SELECT count(*) FROM running) AS considered,
          {next_due} AS next_due_in


-- name: next_due
-- PostgreSQL, a fragment of claim_lease and next_due_in: the seconds from {clock}
-- to the available_at of the first unfinished row not due yet (scheduled, or
-- waiting out a retry), NULL when there is none; {firsts} is next_due_first once
-- per due index read (both, but the unordered one alone in claim_unordered: its
-- relay claims no ordered row before its next whole claim). An index probe each,
-- so the rows scheduled for later cost it nothing. An idle relay waits for that
-- row, not for the poll interval: no NOTIFY announces a row coming due.
(SELECT extract(epoch FROM least({firsts}) - {clock}))


-- name: next_due_first
-- PostgreSQL, a fragment of next_due: the first available_at after {clock} in
-- one due index (outbox_due_idx or outbox_ordered_due_idx, {part} saying which),
-- one probe. Written as ORDER BY ... LIMIT 1 rather than min(): the same plan,
-- planned in less time (about 0.05 ms of a claim's, measured alone).
(SELECT available_at FROM {table}
 WHERE published_at IS NULL AND abandoned_at IS NULL{part} AND available_at > {clock}{window}
 ORDER BY available_at LIMIT 1)


-- name: next_due_in
-- PostgreSQL: next_due by the statement's clock, for a relay about to rest after
-- a claim that found nothing (a claim that found rows returned it).
SELECT {next_due}


-- name: mark_published
-- PostgreSQL: PROCESSING -> PUBLISHED for the rows of one batch that are still
-- under its lease (the fragment lease_held); store.record's published rows.
-- Parameters: the ids as one array's text ("{1,2,3}", which the relay writes in
-- microseconds: the driver's quoting of a list of 500 ids took half a
-- millisecond), token. published_at is the statement's time, as Django's Now().
UPDATE {table}
SET status = {published}, published_at = statement_timestamp(),
    locked_until = NULL, last_error = ''
WHERE id = ANY(%s::bigint[]) AND {lease_held}


-- name: delete_published
-- PostgreSQL: PROCESSING -> deleted, store.record's published rows when
-- PUBLISHED_RETENTION is 0 (no PUBLISHED row is kept): the rows of one batch
-- still under its lease (lease_held), as mark_published. A delete writes no new
-- row version and no index entry. Parameters as mark_published; returns the
-- ids deleted (the others were taken over by another relay).
DELETE FROM {table}
WHERE id = ANY(%s::bigint[]) AND {lease_held}
RETURNING id


-- name: lease_held
-- PostgreSQL, a boolean fragment of mark_published and delete_published: the
-- row is still under the lease whose token is the parameter (a relay whose lease
-- was taken over writes nothing). chaos --sabotage lease replaces it with a test
-- that every row passes.
lease_token = %s


-- name: ordered_gate
-- PostgreSQL, a boolean fragment of claim: the ordered row "head" is the head
-- of its key (no earlier row of its destination and ordering key is
-- unfinished, that is without published_at; an ABANDONED one blocks the key).
-- An index probe of outbox_key_unfinished_idx. chaos --sabotage order replaces it with TRUE.
NOT EXISTS (
    SELECT 1 FROM {table} AS earlier
    WHERE earlier.destination = head.destination
      AND earlier.ordering_key = head.ordering_key
      AND earlier.sequence < head.sequence AND earlier.published_at IS NULL{window}
)


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


-- name: insert_deduplicated
-- PostgreSQL: stage new rows that each carry a dedup key (none of an ordered
-- route, no two alike); {rows} is deduplicated_row once per row. A row whose
-- (destination, dedup_key) already has an unfinished row (the unique partial
-- index outbox_dedup_unfinished_idx, whose condition the ON CONFLICT repeats)
-- is not inserted: the statement waits for a concurrent transaction that
-- staged the key, and locks the row it conflicts with, whether or not it
-- changes it. With {replace} true that row takes the new payload, headers and
-- available_at unless a relay holds it (PROCESSING). Returns the rows inserted
-- (their own event_id) and the rows replaced (the existing row's event_id).
INSERT INTO {table} AS existing (event_id, event_type, destination, payload, headers,
                                 ordering_key, available_at, status, attempts, locked_by,
                                 last_error, dedup_key)
VALUES {rows}
ON CONFLICT (destination, dedup_key)
    WHERE published_at IS NULL AND abandoned_at IS NULL AND dedup_key IS NOT NULL
DO UPDATE SET payload = excluded.payload, headers = excluded.headers,
              available_at = excluded.available_at
    WHERE {replace} AND existing.status <> {processing}
RETURNING event_id, destination, dedup_key, id, available_at, created_at


-- name: deduplicated_row
-- PostgreSQL: one new row of insert_deduplicated (parameters: event_id,
-- event_type, destination, payload, headers, ordering_key, available_at or
-- NULL, dedup_key).
(%s, %s, %s, %s::jsonb, %s::jsonb, %s, coalesce(%s, statement_timestamp()), {pending}, 0, '', '', %s)


-- name: insert_ordered
-- PostgreSQL: stage new rows, some of them on ordered routes, in one
-- statement. {scopes} is sequence_scope once per (destination, ordering_key)
-- of the ordered rows, sorted (so that writers of several keys lock their
-- counters in one order and cannot deadlock): each counter row is created or
-- advanced by its number of rows, and its row lock is held until the staging
-- transaction ends, which orders the writers of a key by commit. {rows} is
-- ordered_row once per row; an ordered row's place counts back from its
-- scope's last number (the scope's last row 0), an unordered row's is NULL
-- and its sequence stays NULL. Returns what the database filled in.
WITH counters AS (
    INSERT INTO {sequences} AS counter (destination, ordering_key, last_sequence)
    VALUES {scopes}
    ON CONFLICT (destination, ordering_key)
    DO UPDATE SET last_sequence = counter.last_sequence + excluded.last_sequence
    RETURNING destination, ordering_key, last_sequence
), staged (event_id, event_type, destination, payload, headers, ordering_key,
           available_at, place) AS (
    VALUES {rows}
)
INSERT INTO {table} (event_id, event_type, destination, payload, headers, ordering_key,
                     available_at, status, attempts, locked_by, last_error, sequence)
SELECT staged.event_id, staged.event_type, staged.destination, staged.payload,
       staged.headers, staged.ordering_key,
       coalesce(staged.available_at, statement_timestamp()), {pending}, 0, '', '',
       counters.last_sequence - staged.place
FROM staged LEFT JOIN counters
    ON staged.place IS NOT NULL AND counters.destination = staged.destination
   AND counters.ordering_key = staged.ordering_key
RETURNING event_id, id, available_at, created_at, sequence


-- name: sequence_scope
-- PostgreSQL: one counter of insert_ordered (parameters: destination,
-- ordering_key, how many numbers it takes).
(%s, %s, %s::bigint)


-- name: ordered_row
-- PostgreSQL: one new row of insert_ordered (parameters: event_id, event_type,
-- destination, payload, headers, ordering_key, available_at or NULL, place or
-- NULL).
(%s::uuid, %s, %s, %s::jsonb, %s::jsonb, %s, %s::timestamptz, %s::bigint)


-- name: backlog
-- PostgreSQL: the backlog's figures in one statement, for a scrape, the
-- admin's summary and the minute's sample: {figures} are backlog_count,
-- backlog_oldest_due and backlog_blocked, as many as asked for, in order.
SELECT {figures}


-- name: backlog_count
-- PostgreSQL, a fragment of backlog: the rows in {status}{part}, counted up to
-- the parameter (the exact limit plus one). Each reads one partial index: the
-- state's own, or for PENDING and PROCESSING (which have none) one of the due
-- indexes; the part is that index's condition (with "AND sequence IS NULL" or
-- "IS NOT NULL" for a due index, and for PENDING rows backlog_part_due or
-- backlog_part_scheduled).
(SELECT count(*) FROM (SELECT 1 FROM {table} WHERE status = {status}{part} LIMIT %s) AS counted)


-- name: backlog_part_unfinished
-- PostgreSQL, the part of backlog_count for PENDING and PROCESSING: the due
-- indexes' condition (models.UNFINISHED).
 AND published_at IS NULL AND abandoned_at IS NULL


-- name: backlog_part_due
-- PostgreSQL, added to backlog_part_unfinished for PENDING: the rows due at the
-- statement's clock (the backlog), a range of the due index's leading column.
 AND available_at <= statement_timestamp()


-- name: backlog_part_scheduled
-- PostgreSQL, added to backlog_part_unfinished for the scheduled events: PENDING
-- rows not due yet, the rest of that range; a claim never reads them.
 AND available_at > statement_timestamp()


-- name: backlog_part_failed
-- PostgreSQL, the part of backlog_count for FAILED: outbox_failed_idx's
-- condition (models.ERRORED).
 AND last_error <> '' AND published_at IS NULL AND abandoned_at IS NULL


-- name: backlog_part_published
-- PostgreSQL, the part of backlog_count for PUBLISHED: outbox_published_idx's.
 AND published_at IS NOT NULL


-- name: backlog_part_abandoned
-- PostgreSQL, the part of backlog_count for ABANDONED: outbox_abandoned_idx's.
 AND abandoned_at IS NOT NULL


-- name: backlog_oldest_due
-- PostgreSQL, a fragment of backlog: the available_at of the oldest due row of
-- one due index, {part} saying which (as in backlog_count). Due (claim_due) by
-- the clock of the ORM's Now() (the statement's, not the transaction's).
(SELECT min(available_at) FROM {table} WHERE {due}{part})


-- name: backlog_blocked
-- PostgreSQL, a fragment of backlog: the blocked keys (those whose head is
-- ABANDONED; {gate} is ordered_gate, so chaos --sabotage order changes this
-- figure too), counted up to the parameter.
(SELECT count(*) FROM (
    SELECT 1 FROM {table} AS head
    WHERE head.status = {abandoned} AND head.abandoned_at IS NOT NULL
      AND head.sequence IS NOT NULL AND {gate}
    LIMIT %s
) AS blocked)


-- name: oldest_snapshot
-- PostgreSQL: the other session of this database whose snapshot is the oldest (its
-- backend_xmin): while it holds it, vacuum keeps every row version deleted or updated
-- since, the outbox rows the relays finished among them, and each claim reads past
-- them. Its pid, user, application, state and how long its transaction has been open.
SELECT pid, coalesce(usename, ''), coalesce(application_name, ''), coalesce(state, ''),
       extract(epoch FROM clock_timestamp() - coalesce(xact_start, query_start))::float8
FROM pg_stat_activity
WHERE datname = current_database() AND backend_xmin IS NOT NULL AND pid <> pg_backend_pid()
ORDER BY age(backend_xmin) DESC, xact_start
LIMIT 1


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


-- name: partitioned
-- PostgreSQL: whether the outbox table (its quoted name is the parameter) is a
-- partitioned table (outbox_partition made it one).
SELECT EXISTS (SELECT 1 FROM pg_partitioned_table WHERE partrelid = to_regclass(%s))


-- name: dedup_partitioned
-- PostgreSQL, before a staging with dedup keys: lock the outbox table as the INSERT
-- would (ROW EXCLUSIVE: it waits for outbox_partition, and then names the table
-- outbox_partition made), then whether it is partitioned ({name}: its quoted name as
-- a literal). One round trip.
LOCK TABLE {table} IN ROW EXCLUSIVE MODE;
SELECT EXISTS (SELECT 1 FROM pg_partitioned_table WHERE partrelid = {name}::regclass)


-- name: partitions
-- PostgreSQL: the partitions of a partitioned table (its quoted name is the
-- parameter) and their bounds as PostgreSQL prints them: "FOR VALUES FROM ('1')
-- TO ('1001')", "FOR VALUES FROM (MINVALUE) TO ('1001')" or "DEFAULT".
SELECT child.relname, pg_get_expr(child.relpartbound, child.oid)
FROM pg_inherits JOIN pg_class AS child ON child.oid = pg_inherits.inhrelid
WHERE pg_inherits.inhparent = %s::regclass


-- name: next_id
-- PostgreSQL: the id the next row staged takes, or a greater one: {sequence} is the
-- sequence of the table's identity column (pg_get_serial_sequence's answer, quoted
-- by PostgreSQL). Every id below it is drawn: a row holding one is inserted or being
-- inserted by a statement that holds a lock on the table.
SELECT CASE WHEN is_called THEN last_value + 1 ELSE last_value END FROM {sequence}


-- name: serial_sequence
-- PostgreSQL: the sequence of a table's id column (the table's quoted name is the
-- parameter), as a qualified name quoted where it must be.
SELECT pg_get_serial_sequence(%s, 'id')


-- name: convert_timeouts
-- PostgreSQL: outbox_partition waits at most {timeout} for the table (staging
-- queues behind its lock meanwhile), and no statement_timeout of the site's cuts the
-- conversion short: it reads the table's rows once.
SET LOCAL lock_timeout = {timeout};
SET LOCAL statement_timeout = 0


-- name: partition_create
-- PostgreSQL: an empty table shaped as {table} (columns, defaults, CHECK
-- constraints; not the identity), to be attached as a partition. {storage} is
-- the storage parameters of the table's first partition (WITH (fillfactor=50)).
CREATE TABLE {partition} (LIKE {table} INCLUDING DEFAULTS INCLUDING CONSTRAINTS) {storage}


-- name: partition_attach
-- PostgreSQL: attach an empty table as the ids [{lower}, {upper}). Takes a SHARE
-- UPDATE EXCLUSIVE lock on {table} (staging and claims go on) and an ACCESS
-- EXCLUSIVE one on its default partition, which it reads to check that no row
-- there belongs to the new range; builds the table's indexes (it is empty).
ALTER TABLE {table} ATTACH PARTITION {partition} FOR VALUES FROM ({lower}) TO ({upper})


-- name: partition_expiry
-- PostgreSQL: what keeps one partition: whether it holds unfinished rows, whether
-- it holds an ABANDONED ordered row (never deleted: retention.py), the latest
-- published_at and abandoned_at, and the database clock. Each part reads an index
-- (the due indexes, outbox_abandoned_idx, outbox_published_idx), not the rows.
SELECT EXISTS (SELECT 1 FROM {partition}
               WHERE published_at IS NULL AND abandoned_at IS NULL
                 AND (sequence IS NULL OR sequence IS NOT NULL)),
       EXISTS (SELECT 1 FROM {partition}
               WHERE abandoned_at IS NOT NULL AND sequence IS NOT NULL),
       (SELECT max(published_at) FROM {partition} WHERE published_at IS NOT NULL),
       (SELECT max(abandoned_at) FROM {partition} WHERE abandoned_at IS NOT NULL),
       statement_timestamp()


-- name: partition_blockers
-- PostgreSQL: the first rows that keep one partition (parameter: how many): the
-- unfinished ones and the ABANDONED ordered ones, as partition_expiry tells them.
(SELECT id FROM {partition}
 WHERE published_at IS NULL AND abandoned_at IS NULL AND (sequence IS NULL OR sequence IS NOT NULL)
 UNION
 SELECT id FROM {partition} WHERE abandoned_at IS NOT NULL AND sequence IS NOT NULL)
ORDER BY id
LIMIT %s


-- name: partition_lock
-- PostgreSQL: hold one partition still (no row of it changes) until the
-- transaction ends.
LOCK TABLE {partition} IN ACCESS EXCLUSIVE MODE


-- name: partition_drop
-- PostgreSQL: drop one partition, rows and indexes at once: no row is deleted, no
-- dead tuple is left, and the WAL holds a few records. Takes an ACCESS EXCLUSIVE
-- lock on {table} for the moment it runs.
DROP TABLE {partition}


-- name: convert_lock
-- PostgreSQL: outbox_partition holds the table alone while it turns it into a
-- partitioned one: staging, claims and the admin wait.
LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE


-- name: convert_names
-- PostgreSQL: the table's primary key constraint and its identity sequence (the
-- table's quoted name is the parameter, twice), kept by the partitioned table.
SELECT (SELECT conname FROM pg_constraint WHERE conrelid = %s::regclass AND contype = 'p'),
       (SELECT relname FROM pg_class WHERE oid = pg_get_serial_sequence(%s, 'id')::regclass)


-- name: convert_indexes
-- PostgreSQL: the indexes of one table (its quoted name is the parameter), each
-- with the constraint it backs (NULL: none) and whether it is attached to an index
-- of a partitioned table.
SELECT index.relname, con.conname,
       EXISTS (SELECT 1 FROM pg_inherits WHERE inhrelid = pg_index.indexrelid)
FROM pg_index
JOIN pg_class AS index ON index.oid = pg_index.indexrelid
LEFT JOIN pg_constraint AS con
    ON con.conindid = pg_index.indexrelid AND con.conrelid = pg_index.indrelid
WHERE pg_index.indrelid = %s::regclass
ORDER BY index.relname


-- name: convert_acl
-- PostgreSQL: the table's owner, and the GRANTs that give its privileges again on
-- {table} (the partitioned table that takes its name), to each role but its owner
-- (the table's quoted name is the parameter).
SELECT pg_get_userbyid(c.relowner),
       coalesce(array_agg(format('GRANT %%s ON TABLE {table} TO %%s%%s', a.privilege_type,
                                 CASE WHEN a.grantee = 0 THEN 'PUBLIC'
                                      ELSE quote_ident(pg_get_userbyid(a.grantee)) END,
                                 CASE WHEN a.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END))
                FILTER (WHERE a.grantee IS NOT NULL AND a.grantee <> c.relowner), '{}')
FROM pg_class AS c LEFT JOIN LATERAL aclexplode(c.relacl) AS a ON true
WHERE c.oid = %s::regclass
GROUP BY c.relowner


-- name: convert_owner
-- PostgreSQL: the partitioned table takes the table's owner.
ALTER TABLE {table} OWNER TO {owner}


-- name: convert_attachments
-- PostgreSQL: what outbox_partition would leave on the first partition rather than
-- carry over (the table's quoted name is the parameter, three times): the
-- publications that name the table, its own triggers (not the package's NOTIFY
-- trigger) and its row security policies.
SELECT (SELECT count(*) FROM pg_publication_rel WHERE prrelid = %s::regclass),
       (SELECT count(*) FROM pg_trigger
        WHERE tgrelid = %s::regclass AND NOT tgisinternal AND tgname <> 'django_outbox_notify'),
       (SELECT count(*) FROM pg_policy WHERE polrelid = %s::regclass)


-- name: convert_storage
-- PostgreSQL: a table's storage parameters (its quoted name is the parameter), as
-- "fillfactor=50" items.
SELECT coalesce(reloptions, '{}') FROM pg_class WHERE oid = %s::regclass


-- name: convert_rename
-- PostgreSQL: the table, with its rows, becomes the first partition.
ALTER TABLE {table} RENAME TO {partition}


-- name: convert_rename_index
-- PostgreSQL: an index of the first partition gives its name to the partitioned
-- table's index.
ALTER INDEX {index} RENAME TO {name}


-- name: convert_detach_identity
-- PostgreSQL: the first partition gives up its identity (and its sequence) and
-- the trigger of notify_trigger: the partitioned table takes both over.
ALTER TABLE {partition} ALTER COLUMN id DROP IDENTITY IF EXISTS;
DROP TRIGGER IF EXISTS django_outbox_notify ON {partition}


-- name: convert_parent
-- PostgreSQL: the partitioned table, shaped as the first partition, partitioned
-- by ranges of id; it takes the id sequence's name and the next value.
CREATE TABLE {table} (LIKE {partition} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
    PARTITION BY RANGE (id);
ALTER TABLE {table} ALTER COLUMN id
    ADD GENERATED BY DEFAULT AS IDENTITY (SEQUENCE NAME {sequence} START WITH {start});
ALTER TABLE {table} ADD CONSTRAINT {pkey} PRIMARY KEY (id)


-- name: convert_attach_first
-- PostgreSQL: the table's rows, the ids below {upper}, become the first
-- partition. PostgreSQL reads them to check the range, attaches the indexes the
-- partitioned table's match and builds the others.
ALTER TABLE {table} ATTACH PARTITION {partition} FOR VALUES FROM (MINVALUE) TO ({upper})


-- name: convert_drop_index
-- PostgreSQL: an index of the first partition left unattached: one of the unique
-- indexes a partitioned table cannot have (their non-unique twins replace them).
DROP INDEX {index}


-- name: convert_drop_constraint
-- PostgreSQL: a unique constraint of the first partition (and its index) that a
-- partitioned table cannot have.
ALTER TABLE {partition} DROP CONSTRAINT {constraint}


-- name: maintenance_lock
-- PostgreSQL: one transaction at a time makes or drops a partition (two relays'
-- retention passes would make the same range twice): a transaction-level advisory
-- lock, taken without waiting (true: taken; a connection pooler in transaction mode
-- keeps it whole). The statements after it wait for a lock a little longer than
-- deadlock_timeout, after which PostgreSQL cancels an autovacuum in their way, and
-- then give up until the next pass (staging queues behind their lock meanwhile).
SELECT pg_try_advisory_xact_lock(1869968500, 1),
       set_config('lock_timeout',
                  (extract(epoch FROM current_setting('deadlock_timeout')::interval) * 1000
                   + 500)::int || 'ms', true)


-- name: partition_default
-- PostgreSQL: the partition that takes the rows no range does: staging never
-- fails when the relays have not made partitions ahead in time.
CREATE TABLE {partition} PARTITION OF {table} DEFAULT {storage}


-- name: dedup_locks
-- PostgreSQL, a partitioned outbox (no unique index can span its partitions): lock
-- the (destination, dedup key)s staged for the rest of the transaction, each through
-- one of 1,024 buckets of their hash (two keys may share one: they then wait for each
-- other, which costs a moment and breaks nothing; a stage_many of many keys takes at
-- most 1,024 locks), the buckets in order (two transactions never wait for each
-- other in a cycle); {rows} is dedup_lock once per key. A transaction that staged a
-- key holds its bucket until it ends, so the next statement of this one sees its row
-- at READ COMMITTED: returns the transaction's isolation level, which the caller
-- checks. The first key, 1869968501, is the package's dedup keys' (1869968500 is its
-- partition maintenance's, maintenance_lock).
SELECT count(pg_advisory_xact_lock(1869968501, bucket) IS NULL),
       current_setting('transaction_isolation')
FROM (SELECT DISTINCT hashtext(scope.destination || chr(31) || scope.dedup_key) & 1023 AS bucket
      FROM (VALUES {rows}) AS scope (destination, dedup_key)
      ORDER BY bucket) AS buckets


-- name: dedup_lock
-- PostgreSQL: one key of dedup_locks (parameters: destination, dedup key).
(%s::text, %s::text)


-- name: claim_window
-- PostgreSQL, a fragment of the claim's parts on a partitioned outbox: the ids a
-- relay's claim reads, from the first range that may hold a row to claim to the
-- top of the ranges ({column}: id, or o.id in claim_lease). Constants, so that
-- PostgreSQL leaves the other partitions out when it plans the claim rather than
-- planning every one (django_outbox.db.partitions.claim_window).
 AND {column} >= {lower} AND {column} < {upper}
